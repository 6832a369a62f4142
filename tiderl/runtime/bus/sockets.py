"""The bus sockets: coordinator ROUTER + PUB, rank DEALER, ``tiderl top`` SUB, all CurveZMQ.

::

    rank daemons   DEALER id=b"rank-<r>" ──┐ reports, heartbeats, acks
    tiderl CLI     DEALER                ──┤            ▼
                                           └─► ROUTER ─► BusServer.recv() ─► coordinator loop
                                   commands ◄── ROUTER ◄── BusServer.send(identity, msg)
    tiderl top     SUB ◄── PUB ◄── BusServer.publish(Snapshot)

    BusServer's gatekeeper thread: ZAP handler (admits the job's client key only) + a reader of
    the ROUTER/PUB monitor events (logs peers that fail before ZAP, e.g. plain non-CURVE ones).

Each object owns its ``zmq.Context`` (no process-wide singleton): only one ZAP handler may bind
per context, and terminating an owned context on close is what makes close bounded (LINGER).
Sends never block: a full queue or an unknown ROUTER identity raises :class:`BusSendError` so the
coordinator decides what a stuck or missing rank means. Received frames that break the wire format
are logged and dropped; ``recv`` keeps waiting for the next valid message until its timeout.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from tiderl.runtime.bus.keys import BusKeyError, JobKeys
from tiderl.runtime.bus.messages import BusProtocolError, Message, decode, encode

log = logging.getLogger(__name__)

LINGER_MS = 200  # bounds close(): enough to flush a last report on a LAN, never a hang
QUEUE_HWM = 100_000  # per peer, commands and reports; a queue this deep means a stuck peer
SNAPSHOT_HWM = 100  # snapshots are droppable: a slow `tiderl top` must not grow the coordinator
ZAP_DOMAIN = b"tiderl"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZeroMQ's ZAP spec (RFC 27)
LINK_PING_MS, LINK_TIMEOUT_MS = 1000, 5000  # a client's ZMTP heartbeat to the coordinator
REJECTION_LOG_S = 60.0  # a rejected plain peer reconnects every ~0.1 s: one warning a minute


class BusError(RuntimeError):
    """A bus operation that cannot be done (the wire-format error is BusProtocolError)."""


class BusSendError(BusError):
    """A send to a peer that is not connected, or whose queue is full."""


def rank_identity(rank: int) -> bytes:
    """The ROUTER identity of rank ``rank``'s DEALER; the coordinator addresses ranks by it."""
    return f"rank-{rank}".encode()


def set_curve_server(sock: zmq.Socket, keys: JobKeys) -> None:
    """Make ``sock`` a CURVE server with the job's server pair (the coordinator's sockets)."""
    if keys.server_secret is None:
        raise BusKeyError("these job keys have no server.secret: only the coordinator's host "
                          "holds it")
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN


def set_curve_client(sock: zmq.Socket, keys: JobKeys) -> None:
    """Make ``sock`` a CURVE client of the job's coordinator, with the job's client pair."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def _receive(sock: zmq.Socket, timeout_s: float | None, source: str | None
             ) -> tuple[bytes, Message] | None:
    """Next valid message as (ROUTER identity or b"", message); None after ``timeout_s``.

    ``source`` None means the first frame is a ROUTER identity (and names the sender)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:  # the hot path: a message is already queued, skip the poll
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            wait_ms = -1 if deadline is None else max(0, round(
                (deadline - time.monotonic()) * 1000))
            if not sock.poll(wait_ms):
                return None
            continue
        identity = frames.pop(0) if source is None else b""
        try:
            return identity, decode(frames)
        except BusProtocolError as exc:
            log.warning("bus: dropped a message from %s: %s", source or repr(identity), exc)


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


class _Gatekeeper(threading.Thread):
    """ZAP handler admitting only the job's client key, and logger of pre-ZAP rejections.

    ZeroMQ asks the ZAP handler about every CURVE peer that knows the server key; a peer that
    fails earlier (a plain client: mechanism mismatch) never reaches ZAP, so the sockets'
    monitor events are read here too, to log that rejection as well."""

    def __init__(self, ctx: zmq.Context, client_public: bytes) -> None:
        super().__init__(name="tiderl-bus-gatekeeper", daemon=True)
        self._ctx = ctx
        self._client_key = z85.decode(client_public)
        self._zap = ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(_ZAP_ENDPOINT)  # bound before any server socket can see a peer
        stop_endpoint = f"inproc://tiderl-gatekeeper-stop-{id(self)}"
        self._stop_tx = ctx.socket(zmq.PAIR)
        self._stop_tx.bind(stop_endpoint)
        self._stop_rx = ctx.socket(zmq.PAIR)
        self._stop_rx.connect(stop_endpoint)
        self._monitors: dict[zmq.Socket, str] = {}
        self._quiet_until: dict[str, float] = {}  # rejection -> end of its quiet period
        self._suppressed: dict[str, int] = {}

    def watch(self, sock: zmq.Socket, endpoint: str) -> None:
        """Log handshake failures on ``sock`` (bound at ``endpoint``); call before start()."""
        monitor_endpoint = f"inproc://tiderl-monitor-{id(sock)}"
        # Both: when a plain peer spots the mechanism mismatch first and hangs up, this side
        # sees only a connection lost mid-handshake (NO_DETAIL), not the PROTOCOL error.
        sock.monitor(monitor_endpoint, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.connect(monitor_endpoint)
        self._monitors[monitor] = endpoint

    def run(self) -> None:
        """Serve until close(); the sockets moved to this thread at start() and die here."""
        poller = zmq.Poller()
        for sock in (self._stop_rx, self._zap, *self._monitors):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop_rx in ready:
                    return
                if self._zap in ready:
                    self._answer(self._zap.recv_multipart())
                for monitor, endpoint in self._monitors.items():
                    if monitor in ready:
                        self._report(recv_monitor_message(monitor), endpoint)
        finally:
            for sock in (self._stop_rx, self._zap, *self._monitors):
                sock.close(0)

    def close(self) -> None:
        self._stop_tx.send(b"")
        self.join()
        self._stop_tx.close(0)

    def _answer(self, request: list[bytes]) -> None:
        """One ZAP request: [version, request id, domain, address, identity, mechanism, creds]."""
        request_id, address, mechanism = request[1], request[3], request[5]
        credentials = request[6:]
        admitted = mechanism == b"CURVE" and credentials == [self._client_key]
        if not admitted:
            reason = (f"unknown CURVE key {z85.encode(credentials[0])[:8].decode()}…"
                      if mechanism == b"CURVE" and credentials
                      else f"mechanism {mechanism.decode(errors='replace')}")
            self._warn(f"bus: rejected a peer from {address.decode(errors='replace')} "
                       f"({reason})")
        self._zap.send_multipart([b"1.0", request_id, b"200" if admitted else b"400",
                                  b"OK" if admitted else b"not a key of this job",
                                  b"job-peer" if admitted else b"", b""])

    def _report(self, event: dict, endpoint: str) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            reason = f"{os.strerror(event['value'])}; a peer without CURVE?"
        elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            reason = "the peer does not use CURVE"
        else:
            reason = f"ZMTP protocol error {event['value']:#x}"
        self._warn(f"bus: rejected a peer on {endpoint} (handshake failed: {reason})")

    def _warn(self, line: str) -> None:
        """Log ``line`` at most once per REJECTION_LOG_S, with a count of the repeats held back."""
        now = time.monotonic()
        if now < self._quiet_until.get(line, 0.0):
            self._suppressed[line] = self._suppressed.get(line, 0) + 1
            return
        repeats = self._suppressed.pop(line, 0)
        log.warning("%s%s", line, f" (and {repeats} times in the last {REJECTION_LOG_S:.0f} s)"
                    if repeats else "")
        if len(self._quiet_until) > 1024:  # bound the memory a key-cycling prober can take
            self._quiet_until.clear()
            self._suppressed.clear()
        self._quiet_until[line] = now + REJECTION_LOG_S


class BusServer:
    """The coordinator's end: a ROUTER for commands and reports, a PUB for snapshots.

    ``port``/``pub_port`` 0 pick free ports; :attr:`endpoint` and :attr:`pub_endpoint` say which.
    ``keys`` None runs without CURVE, for the benchmark baseline only, and only on loopback."""

    def __init__(self, keys: JobKeys | None, host: str = "127.0.0.1", port: int = 0,
                 pub_port: int = 0) -> None:
        if keys is None and not ipaddress.ip_address(host).is_loopback:
            raise BusError(f"bus: refusing to bind {host} without CURVE keys (loopback only)")
        self._ctx = zmq.Context()
        self._gatekeeper = None if keys is None else _Gatekeeper(self._ctx, keys.client_public)
        self._router = self._bind(zmq.ROUTER, keys, host, port, QUEUE_HWM)
        self._router.router_mandatory = True  # unknown identity: an error, not a silent drop
        self._router.router_handover = True  # a restarted rank takes its identity back
        self._pub = self._bind(zmq.PUB, keys, host, pub_port, SNAPSHOT_HWM)
        self.endpoint = self._router.last_endpoint.decode()
        self.pub_endpoint = self._pub.last_endpoint.decode()
        if self._gatekeeper is not None:
            self._gatekeeper.watch(self._router, self.endpoint)
            self._gatekeeper.watch(self._pub, self.pub_endpoint)
            self._gatekeeper.start()

    def _bind(self, kind: int, keys: JobKeys | None, host: str, port: int,
              hwm: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = LINGER_MS
        sock.sndhwm = sock.rcvhwm = hwm
        if keys is not None:
            set_curve_server(sock, keys)
        sock.bind(f"tcp://{host}:{port or '*'}")
        return sock

    def recv(self, timeout_s: float | None) -> tuple[bytes, Message] | None:
        """(sender identity, message), or None after ``timeout_s`` (None: wait forever)."""
        return _receive(self._router, timeout_s, source=None)

    def send(self, identity: bytes, msg: Message) -> None:
        """Send ``msg`` to the peer ``identity``; BusSendError if unknown or its queue is full."""
        _send(self._router, [identity, *encode(msg)], type(msg).__name__, repr(identity))

    def publish(self, msg: Message) -> None:
        """Publish to every subscriber; a subscriber too slow to keep up misses snapshots."""
        self._pub.send_multipart(encode(msg), zmq.NOBLOCK)

    def close(self) -> None:
        """Close the sockets first (so no peer is admitted without ZAP), then the gatekeeper."""
        for sock in (self._router, self._pub):
            if self._gatekeeper is not None:
                sock.disable_monitor()
            sock.close()
        if self._gatekeeper is not None:
            self._gatekeeper.close()
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
        got = _receive(self._sock, timeout_s, source="the coordinator")
        return None if got is None else got[1]

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
        got = _receive(self._sock, timeout_s, source="the coordinator's PUB")
        return None if got is None else got[1]
