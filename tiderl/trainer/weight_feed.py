"""The weight feed: a boundary's weights go from the source actor to each receiver over a TCP
connection of the receiver's own, never over a collective the receivers share.

    source actor   publish(version, {part: (layout, state)})   a snapshot of flat buckets
                   (plan_buckets), the only version it serves; the source goes on at once
    receiver       fetch(source address, version, layout, part) ──request──> the source's
                   thread for it ──status, then every bucket's bytes──> flat buffers, viewed
                   under the layout's names (no copy beyond the buffers)

A receiver that dies breaks its own connection and nothing else: no survivor waits on it, so a
death costs the heartbeat window that names it, never a collective's timeout. A source that dies
closes every receiver's connection at once (an error); a source that stops answering (stopped,
or its host gone) is left by a receiver as soon as the rank is told to (``cancel``: the boundary
went out again from another actor), and at the latest after ``stall_s`` without a byte. This is
torchft's way of healing a replica (it pulls the state from a live peer over HTTP) rather than
slime's (an NCCL group with the rollout engines, which a dead engine stops).

Wire format (big-endian)::

    request   "TWF1" | u64 version | u64 layout hash | u8 part | u16 n | n bytes of token
    answer    u8 status (0: ok) | u32 n | n bytes of UTF-8 (the error when status != 0)
              then, when ok, every bucket's bytes in plan order

Both sides compute the same bucket plan from the layout; the layout hash makes a mismatch an
error instead of garbage. The token (the job's, :mod:`tiderl.auth`) keeps other processes on the
host from reading the weights.
"""

from __future__ import annotations

import hmac
import logging
import math
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiderl.trainer.sync import Bucket, Layout, layout_hash, plan_buckets, unpack_bucket

log = logging.getLogger("tiderl.feed")

MAGIC = b"TWF1"
REQUEST = struct.Struct("!4sQQBH")
ANSWER = struct.Struct("!BI")
WEIGHTS, OPTIMIZER = 0, 1  # the parts a source publishes: its weights, its AdamW state
PART_NAMES = {WEIGHTS: "weights", OPTIMIZER: "optimizer state"}
FEED_BUCKET_BYTES = 16 << 20  # per bucket: what a receiver holds beyond the received tensors
POLL_S = 0.2  # how often a blocked receiver looks at its cancel flag
CONNECT_TIMEOUT_S = 10.0  # to connect, and for a request to arrive


class FeedError(RuntimeError):
    """A fetch failed: the source refused it, is gone, or sent nothing for too long."""


class FeedCancelled(FeedError):
    """The rank was told to leave the fetch (a newer boundary came)."""


@dataclass
class Packed:
    """One part of a published version: its buckets' buffers, filled in order while the source
    copies them (a receiver sends each as soon as it is there)."""

    digest: int  # the layout's hash
    total: int  # buckets
    flats: list[torch.Tensor]


@dataclass(frozen=True)
class Published:
    version: int
    parts: dict[int, Packed]


class WeightFeed:
    """The source side: a listening socket, one thread per receiver, the latest version."""

    def __init__(self, token: str = "", *, host: str = "0.0.0.0", port: int = 0,
                 wait_s: float = 120.0, bucket_bytes: int = FEED_BUCKET_BYTES) -> None:
        """``wait_s``: how long a request for a version not yet published waits, and how long a
        send to a receiver may block."""
        self.token, self.wait_s, self.bucket_bytes = token, wait_s, bucket_bytes
        self._listener = socket.create_server((host, port), backlog=64)
        self.port = self._listener.getsockname()[1]
        self._published: Published | None = None
        self._changed = threading.Condition()
        self._closed = False
        self.waiting = 0  # requests waiting for a version not published yet
        threading.Thread(target=self._accept, name="weight-feed", daemon=True).start()

    def publish(self, version: int, parts: dict[int, tuple[Layout, dict[str, torch.Tensor]]]
                ) -> int:
        """Serve ``version`` from now on: a copy, so the caller may change its tensors once
        this returns; receivers get each bucket as soon as it is copied. The bytes published;
        ValueError (nothing published) when a state does not fit its layout."""
        plans = {}
        for part, (layout, state) in parts.items():
            check_state(layout, state)
            plans[part] = (state, plan_buckets(layout, self.bucket_bytes))
        published = Published(version, {
            part: Packed(layout_hash(layout), len(plans[part][1]), [])
            for part, (layout, _) in parts.items()})
        with self._changed:
            self._published = published
            self._changed.notify_all()
        num_bytes = 0
        for part, (state, buckets) in plans.items():
            for bucket in buckets:
                flat = torch.empty(bucket.numel, dtype=bucket.dtype)
                fill_bucket(bucket, state, flat)
                num_bytes += flat.numel() * flat.element_size()
                with self._changed:
                    published.parts[part].flats.append(flat)
                    self._changed.notify_all()
        return num_bytes

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="weight-feed-send",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(CONNECT_TIMEOUT_S)  # the request comes at once, or never
            try:
                magic, version, digest, part, size = REQUEST.unpack(
                    _read_exactly(conn, REQUEST.size))
                token = _read_exactly(conn, size).decode(errors="replace") if size else ""
                conn.settimeout(self.wait_s)  # a send may block this long (a stopped reader)
                if magic != MAGIC or not hmac.compare_digest(token, self.token):
                    conn.sendall(_answer(1, "refused: not a weight-feed request of this job"))
                    return
                packed, problem = self._wait_for(version, digest, part)
                if packed is None:
                    conn.sendall(_answer(1, problem))
                    return
                conn.sendall(_answer(0, ""))
                for index in range(packed.total):
                    flat = self._bucket(packed, index)
                    if flat is None:
                        return  # closing
                    conn.sendall(memoryview(flat.view(torch.uint8).numpy()))
            except (OSError, struct.error, FeedError) as exc:  # the receiver went away
                log.info("weight feed: a receiver's transfer ended early (%s)", exc)

    def _bucket(self, packed: Packed, index: int) -> torch.Tensor | None:
        with self._changed:
            self._changed.wait_for(lambda: self._closed or len(packed.flats) > index)
            return None if self._closed else packed.flats[index]

    def _wait_for(self, version: int, digest: int, part: int) -> tuple[Packed | None, str]:
        deadline = time.monotonic() + self.wait_s
        with self._changed:
            self.waiting += 1
            try:
                while not self._closed and (self._published is None
                                            or self._published.version < version):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None, (f"version {version} was not published within "
                                      f"{self.wait_s:g} s")
                    self._changed.wait(left)
            finally:
                self.waiting -= 1
            published = self._published
        if published is None or self._closed:
            return None, "the source is closing"
        if published.version != version:
            return None, (f"version {version} is not served: the source serves "
                          f"{published.version}")
        if part not in published.parts:
            return None, f"version {version} was published without its {PART_NAMES.get(part)}"
        packed = published.parts[part]
        if packed.digest != digest:
            return None, ("the receiver's layout differs from the source's "
                          f"({PART_NAMES[part]})")
        return packed, ""


def fetch(address: str, version: int, layout: Layout, part: int = WEIGHTS, *, token: str = "",
          cancel: Callable[[], bool] = lambda: False, stall_s: float = 120.0,
          device: torch.device | None = None, bucket_bytes: int = FEED_BUCKET_BYTES
          ) -> dict[str, torch.Tensor]:
    """``part`` of ``version`` from the feed at ``address`` ("host:port"), as tensors on
    ``device`` (default: CPU) under the layout's names. FeedCancelled once ``cancel()`` is true;
    FeedError when the source refuses, is gone, or sends nothing for ``stall_s``."""
    host, _, port = address.rpartition(":")
    what = f"{PART_NAMES.get(part, part)} of version {version} from {address}"
    try:
        conn = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        raise FeedError(f"cannot fetch the {what}: {exc}") from None
    with conn:
        reader = _Reader(conn, cancel, stall_s, what)
        encoded = token.encode()
        conn.sendall(REQUEST.pack(MAGIC, version, layout_hash(layout), part, len(encoded))
                     + encoded)
        status, size = ANSWER.unpack(reader.read(ANSWER.size))
        message = reader.read(size).decode(errors="replace") if size else ""
        if status != 0:
            raise FeedError(f"the source refused the {what}: {message}")
        received: dict[str, torch.Tensor] = {}
        for bucket in plan_buckets(layout, bucket_bytes):
            flat = torch.empty(bucket.numel, dtype=bucket.dtype)
            reader.read_into(memoryview(flat.view(torch.uint8).numpy()))
            if device is not None and device.type != "cpu":
                flat = flat.to(device)
            received.update(unpack_bucket(bucket, flat))
    return received


class _Reader:
    """Blocking reads in POLL_S slices: each slice looks at ``cancel``, and a stall of
    ``stall_s`` without a byte is an error."""

    def __init__(self, conn: socket.socket, cancel: Callable[[], bool], stall_s: float,
                 what: str) -> None:
        self.conn, self.cancel, self.stall_s, self.what = conn, cancel, stall_s, what
        conn.settimeout(POLL_S)

    def read(self, size: int) -> bytes:
        buffer = bytearray(size)
        self.read_into(memoryview(buffer))
        return bytes(buffer)

    def read_into(self, view: memoryview) -> None:
        got, last = 0, time.monotonic()
        while got < len(view):
            if self.cancel():
                raise FeedCancelled(f"left the fetch of the {self.what}: a newer boundary came")
            try:
                n = self.conn.recv_into(view[got:])
            except TimeoutError:
                if time.monotonic() - last > self.stall_s:
                    raise FeedError(f"the {self.what} stalled: nothing for "
                                    f"{self.stall_s:g} s") from None
                continue
            except OSError as exc:
                raise FeedError(f"the {self.what} broke off: {exc}") from None
            if n == 0:
                raise FeedError(f"the {self.what} broke off: the source closed the "
                                "connection (is it gone?)")
            got, last = got + n, time.monotonic()


def check_state(layout: Layout, state: dict[str, torch.Tensor]) -> None:
    """ValueError, in words, when ``state`` lacks an entry of ``layout`` or has another shape."""
    for name, shape, _ in layout:
        tensor = state.get(name)
        if tensor is None or tuple(tensor.shape) != shape:
            got = "nothing" if tensor is None else f"shape {tuple(tensor.shape)}"
            raise ValueError(f"the source state has {got} for {name}, the layout says {shape}")


def fill_bucket(bucket: Bucket, state: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the bucket's tensors of ``state`` into ``flat`` (cast to its dtype)."""
    with torch.no_grad():
        for name, shape, offset in bucket.entries:
            flat[offset:offset + math.prod(shape)].view(shape).copy_(state[name])


def _answer(status: int, message: str) -> bytes:
    encoded = message.encode()[:4096]
    return ANSWER.pack(status, len(encoded)) + encoded


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    buffer = bytearray()
    while len(buffer) < size:
        chunk = conn.recv(size - len(buffer))
        if not chunk:
            raise FeedError("the receiver closed the connection")
        buffer += chunk
    return bytes(buffer)


def local_address(toward: str) -> str:
    """The IP address this host uses to reach ``toward`` (a host name or address): where other
    ranks reach this one's feed. No packet is sent (a UDP socket's route lookup)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((toward, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
