"""The bus sockets: coordinator ROUTER + PUB, rank DEALER, ``tiderl top`` SUB, all CurveZMQ.

::

    rank daemons   DEALER id=b"rank-<r>", key rank-<r> ──┐ reports, heartbeats, acks
    tiderl CLI     DEALER id=b"ctl-…", key operator     ──┤            ▼
                          └─► ROUTER ─► BusServer.recv(): decode, gatekeeper.refusal ─► coordinator
                  commands ◄── ROUTER ◄── BusServer.send(identity, msg)
    tiderl top     SUB, key operator ◄── PUB ◄── BusServer.publish(Snapshot)

    BusServer's gatekeeper thread (:mod:`tiderl.runtime.bus.gatekeeper`): the ZAP handler (admits
    the job's keys, naming each one's owner) + a reader of the ROUTER/PUB monitor events (logs
    peers that fail before ZAP, e.g. plain non-CURVE ones).

Each object owns its ``zmq.Context`` (no process-wide singleton): only one ZAP handler may bind
per context, and terminating an owned context on close is what makes close bounded (LINGER).
Sends never block: a full queue or an unknown ROUTER identity raises :class:`BusSendError` so the
coordinator decides what a stuck or missing rank means. Received frames that break the wire format,
and messages a key may not send (another rank's identity or ``rank``, a kind not its owner's), are
dropped, counted (:attr:`BusServer.drops`) and logged, at most once a minute per sender and
reason; ``recv`` keeps waiting for the next valid message until its timeout.

A ROUTER identity is held by one connection at a time (``router_handover`` off): a peer that
claims an identity in use is ignored by ZeroMQ for good (nothing it sends is ever read; the live
one is served on). The identity is free again once the ROUTER has seen its connection end, which
happens in a ``recv`` call (the coordinator's loop makes one every round): a restarted rank gets
back in. A rank that reconnected before that is the ignored one (its link looks up, the
coordinator misses its heartbeats), so the coordinator's end notices a dead link first: its ZMTP
heartbeat times out after SERVER_LINK_TIMEOUT_MS, the ranks' after LINK_TIMEOUT_MS.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from tiderl.core.quote import cut
from tiderl.runtime.bus.gatekeeper import (
    PUB_DOMAIN,
    ROUTER_DOMAIN,
    Gatekeeper,
    LogThrottle,
    refusal,
)
from tiderl.runtime.bus.keys import BusKeyError, JobKeys, ServerKeys
from tiderl.runtime.bus.messages import BusProtocolError, Message, decode, encode

log = logging.getLogger(__name__)

LINGER_MS = 200  # bounds close(): enough to flush a last report on a LAN, never a hang
QUEUE_HWM = 100_000  # per peer, commands and reports; a queue this deep means a stuck peer
SNAPSHOT_HWM = 100  # snapshots are droppable: a slow `tiderl top` must not grow the coordinator
LINK_PING_MS, LINK_TIMEOUT_MS = 1000, 5000  # a client's ZMTP heartbeat to the coordinator
SERVER_LINK_TIMEOUT_MS = 3000  # the coordinator's to each client: its end goes first


class BusError(RuntimeError):
    """A bus operation that cannot be done (the wire-format error is BusProtocolError)."""


class BusSendError(BusError):
    """A send to a peer that is not connected, or whose queue is full."""


def rank_identity(rank: int) -> bytes:
    """The ROUTER identity of rank ``rank``'s DEALER; the coordinator addresses ranks by it."""
    return f"rank-{rank}".encode()


def set_curve_server(sock: zmq.Socket, keys: ServerKeys, zap_domain: bytes = ROUTER_DOMAIN
                     ) -> None:
    """Make ``sock`` a CURVE server with the job's server pair (the coordinator's sockets);
    ``zap_domain`` tells the gatekeeper which socket a peer knocks on."""
    _require_server_keys(keys)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = zap_domain


def _require_server_keys(keys: object) -> None:
    if not isinstance(keys, ServerKeys):
        raise BusKeyError(f"a bus server needs the coordinator's keys (load_job_keys(dir, "
                          f"'coordinator')), not {type(keys).__name__}")


def set_curve_client(sock: zmq.Socket, keys: JobKeys) -> None:
    """Make ``sock`` a CURVE client of the job's coordinator, with the peer's own pair."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def _next_frames(sock: zmq.Socket, deadline: float | None, copy: bool = True) -> list | None:
    """The next multipart message on ``sock``, or None once ``deadline`` (monotonic) passed."""
    while True:
        try:  # the hot path: a message is already queued, skip the poll
            return sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            wait_ms = -1 if deadline is None else max(0, round(
                (deadline - time.monotonic()) * 1000))
            if not sock.poll(wait_ms):
                return None


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _receive(sock: zmq.Socket, timeout_s: float | None, source: str) -> Message | None:
    """The next valid message from the coordinator's side, or None after ``timeout_s``."""
    deadline = _deadline(timeout_s)
    while (frames := _next_frames(sock, deadline)) is not None:
        try:
            return decode(frames)
        except BusProtocolError as exc:
            log.warning("bus: dropped a message from %s: %s", source, exc)
    return None


def _send(sock: zmq.Socket, frames: list[bytes], what: str, peer: str) -> None:
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        raise BusSendError(f"bus: cannot send {what} to {peer}: its queue is full "
                           f"({QUEUE_HWM} messages); is the peer stuck?") from None
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise
        raise BusSendError(f"bus: cannot send {what} to {peer}: no such peer is connected") \
            from None


@dataclass
class DropCounts:
    """The messages :meth:`BusServer.recv` dropped, by why."""

    malformed: int = 0  # broke the wire format (messages.decode)
    forged: int = 0  # not sent as their key's owner: another rank's identity or ``rank``
    forbidden: int = 0  # a kind their key may not send (a rank's Rebalance, the operator's Hello)

    @property
    def total(self) -> int:
        return self.malformed + self.forged + self.forbidden


class BusServer:
    """The coordinator's end: a ROUTER for commands and reports, a PUB for snapshots.

    ``port``/``pub_port`` 0 pick free ports; :attr:`endpoint` and :attr:`pub_endpoint` say which.
    ``keys`` None runs without CURVE (so no peer is known by its key, and only the wire format
    is checked), for the benchmark baseline and tests only, and only on loopback."""

    def __init__(self, keys: ServerKeys | None, host: str = "127.0.0.1", port: int = 0,
                 pub_port: int = 0) -> None:
        if keys is None and not ipaddress.ip_address(host).is_loopback:
            raise BusError(f"bus: refusing to bind {host} without CURVE keys (loopback only)")
        if keys is not None:
            _require_server_keys(keys)  # before any socket exists
        self._ctx = zmq.Context()
        self.gatekeeper = None if keys is None else Gatekeeper(self._ctx, keys)
        self.drops = DropCounts()
        self._throttle = LogThrottle(log)
        self._router = self._bind(zmq.ROUTER, keys, host, port, QUEUE_HWM, ROUTER_DOMAIN)
        self._router.router_mandatory = True  # unknown identity: an error, not a silent drop
        self._router.router_handover = False  # a live rank's identity cannot be taken over
        self._router.heartbeat_ivl = LINK_PING_MS  # and a dead link frees it (module docstring)
        self._router.heartbeat_timeout = SERVER_LINK_TIMEOUT_MS
        self._pub = self._bind(zmq.PUB, keys, host, pub_port, SNAPSHOT_HWM, PUB_DOMAIN)
        self.endpoint = self._router.last_endpoint.decode()
        self.pub_endpoint = self._pub.last_endpoint.decode()
        if self.gatekeeper is not None:
            self.gatekeeper.watch(self._router, self.endpoint)
            self.gatekeeper.watch(self._pub, self.pub_endpoint)
            self.gatekeeper.start()

    def _bind(self, kind: int, keys: ServerKeys | None, host: str, port: int, hwm: int,
              zap_domain: bytes) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = LINGER_MS
        sock.sndhwm = sock.rcvhwm = hwm
        if keys is not None:
            set_curve_server(sock, keys, zap_domain)
        sock.bind(f"tcp://{host}:{port or '*'}")
        return sock

    def recv(self, timeout_s: float | None) -> tuple[bytes, Message] | None:
        """(sender identity, message), or None after ``timeout_s`` (None: wait forever)."""
        deadline = _deadline(timeout_s)
        checked = self.gatekeeper is not None
        while (frames := _next_frames(self._router, deadline, copy=not checked)) is not None:
            owner = None
            if checked:  # the ZAP User-Id: which key's connection this came on
                owner = frames[-1].get("User-Id")
                frames = [frame.bytes for frame in frames]
            got = self._admit(owner, frames.pop(0), frames)
            if got is not None:
                return got
        return None

    def _admit(self, owner: str | None, identity: bytes, frames: list[bytes]
               ) -> tuple[bytes, Message] | None:
        try:
            msg = decode(frames)
        except BusProtocolError as exc:
            self.drops.malformed += 1
            self._throttle.warn(f"{owner or identity!r}: malformed",
                                f"bus: dropped a message from {identity!r}: {cut(str(exc))}")
            return None
        why = None if owner is None else refusal(owner, identity, msg)
        if why is None:
            return identity, msg
        setattr(self.drops, why.category, getattr(self.drops, why.category) + 1)
        self._throttle.warn(f"{owner}: {why.reason}", f"bus: dropped a {type(msg).__name__} "
                                                      f"from {identity!r}: {why.reason}")
        return None

    def send(self, identity: bytes, msg: Message) -> None:
        """Send ``msg`` to the peer ``identity``; BusSendError if unknown or its queue is full."""
        _send(self._router, [identity, *encode(msg)], type(msg).__name__, repr(identity))

    def publish(self, msg: Message) -> None:
        """Publish to every subscriber; a subscriber too slow to keep up misses snapshots."""
        self._pub.send_multipart(encode(msg), zmq.NOBLOCK)

    def close(self) -> None:
        """Close the sockets first (so no peer is admitted without ZAP), then the gatekeeper."""
        for sock in (self._router, self._pub):
            if self.gatekeeper is not None:
                sock.disable_monitor()
            sock.close()
        if self.gatekeeper is not None:
            self.gatekeeper.close()
        self._ctx.term()

    def __enter__(self) -> BusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Peer:
    """A connected client socket with its own context."""

    def __init__(self, kind: int, endpoint: str, keys: JobKeys | None, hwm: int,
                 identity: bytes | None = None) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(kind)
        self._sock.linger = LINGER_MS
        self._sock.sndhwm = self._sock.rcvhwm = hwm
        if identity is not None:
            self._sock.identity = identity
        if keys is not None:
            set_curve_client(self._sock, keys)
        self.endpoint = endpoint

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()

    def __enter__(self) -> _Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BusClient(_Peer):
    """A rank's (or the CLI's) end: a DEALER connected to the coordinator's ROUTER.

    ZMTP heartbeats (PING every second, the link is down after 5 s without an answer) and a
    monitor of handshakes and disconnects tell :meth:`down_for` how long the coordinator has
    been unreachable: a rank whose coordinator is gone exits instead of reconnecting forever.
    """

    def __init__(self, endpoint: str, keys: JobKeys | None, identity: bytes) -> None:
        super().__init__(zmq.DEALER, endpoint, keys, QUEUE_HWM, identity)
        self._sock.heartbeat_ivl = LINK_PING_MS
        self._sock.heartbeat_timeout = LINK_TIMEOUT_MS
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._down_since: float | None = time.monotonic()  # not connected yet
        self._sock.connect(endpoint)

    def down_for(self) -> float:
        """Seconds since the link to the coordinator was last up (since creation before the
        first handshake); 0.0 while it is up."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._down_since = None
            elif event == zmq.EVENT_DISCONNECTED and self._down_since is None:
                self._down_since = time.monotonic()
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close()
        super().close()

    def send(self, msg: Message) -> None:
        """Queue ``msg`` for the coordinator; BusSendError if the queue is full."""
        _send(self._sock, encode(msg), type(msg).__name__, "the coordinator")

    def recv(self, timeout_s: float | None) -> Message | None:
        """The next command, or None after ``timeout_s`` (None: wait forever)."""
        return _receive(self._sock, timeout_s, source="the coordinator")

    def fileno(self) -> int:
        """ZeroMQ's notification descriptor, for an event loop's reader: edge-triggered, so a
        reader drains with ``recv(0)`` until None."""
        return self._sock.getsockopt(zmq.FD)


class Subscriber(_Peer):
    """``tiderl top``'s end: a SUB to the coordinator's PUB, subscribed to every kind."""

    def __init__(self, endpoint: str, keys: JobKeys | None) -> None:
        super().__init__(zmq.SUB, endpoint, keys, SNAPSHOT_HWM)
        self._sock.subscribe(b"")
        self._sock.connect(endpoint)

    def recv(self, timeout_s: float | None) -> Message | None:
        """The next published message, or None after ``timeout_s`` (None: wait forever)."""
        return _receive(self._sock, timeout_s, source="the coordinator's PUB")
