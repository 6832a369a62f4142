"""Who may join the bus and what each peer may say: the coordinator's side of CurveZMQ.

::

    a peer's handshake ──► ZAP request ──► Gatekeeper: a key of this job?
                                             yes ──► 200, User-Id = its owner ("rank-3", "operator")
                                             no  ──► 400, logged (rate-limited)
    ROUTER/PUB monitor ──► Gatekeeper: handshake failed before ZAP (a plain peer) ──► logged
    each received message (BusServer.recv) ──► refusal(owner, identity, msg) ──► dropped, logged

ZeroMQ puts the ZAP answer's User-Id on every frame the admitted connection delivers, so the
bus server knows which key sent each message. :func:`refusal` is the rule: a rank key speaks
only as its own rank (ROUTER identity ``rank-<r>``, ``msg.rank == r``) and only rank messages;
the operator key sends only operator messages, under an identity that is not a rank's. The PUB
admits the operator key only (ranks never subscribe).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import NamedTuple

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from tiderl.core.quote import short
from tiderl.runtime.bus.keys import OPERATOR, ServerKeys, rank_of
from tiderl.runtime.bus.messages import OPERATOR_MESSAGES, RANK_MESSAGES, Message

log = logging.getLogger(__name__)

ROUTER_DOMAIN, PUB_DOMAIN = b"tiderl", b"tiderl-pub"  # ZAP domains: which socket asks
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZeroMQ's ZAP spec (RFC 27)
REJECTION_LOG_S = 60.0  # a rejected plain peer reconnects every ~0.1 s: one warning a minute
_OPERATOR_KINDS = ", ".join(m.__name__ for m in OPERATOR_MESSAGES)


class Refusal(NamedTuple):
    """Why a message is dropped: ``category`` "forged" (not the sender's own name) or
    "forbidden" (a kind its key may not send); ``reason`` is bounded text (no message field)."""

    category: str
    reason: str


def refusal(owner: str, identity: bytes, msg: Message) -> Refusal | None:
    """Why the holder of ``owner``'s key may not send ``msg`` from ROUTER ``identity``; None if
    it may. ``owner`` is the ZAP User-Id: "rank-<r>" or "operator"."""
    rank = rank_of(owner)
    if owner == OPERATOR:
        if rank_of(identity.decode(errors="replace")) is not None:
            return Refusal("forged", "the operator key under a rank's identity")
        if type(msg) not in OPERATOR_MESSAGES:
            return Refusal("forbidden", f"the operator key sends {_OPERATOR_KINDS} only")
        return None
    if rank is None:
        return Refusal("forged", f"no key of this job is named {short(owner)}")
    if identity != owner.encode():
        return Refusal("forged", f"it came with {owner}'s key")
    if type(msg) not in RANK_MESSAGES:
        return Refusal("forbidden", "a rank's key sends rank messages only")
    if msg.rank != rank:  # every rank message has the field (messages.RANK_MESSAGES)
        return Refusal("forged", f"its rank field is not {owner}'s")
    return None


class LogThrottle:
    """Logs at most one line per key every ``quiet_s``, the next one with the count held back.

    Not locked: each thread that logs (the gatekeeper, the server's receiver) has its own."""

    def __init__(self, logger: logging.Logger, quiet_s: float = REJECTION_LOG_S) -> None:
        self._log = logger
        self.quiet_s = quiet_s
        self._quiet_until: dict[str, float] = {}  # key -> end of its quiet period
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, line: str) -> None:
        now = time.monotonic()
        if now < self._quiet_until.get(key, 0.0):
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        repeats = self._suppressed.pop(key, 0)
        self._log.warning("%s%s", line, f" (and {repeats} times in the last {self.quiet_s:.0f} s)"
                    if repeats else "")
        if len(self._quiet_until) > 1024:  # bound the memory a key-cycling prober can take
            self._quiet_until.clear()
            self._suppressed.clear()
        self._quiet_until[key] = now + self.quiet_s


class Gatekeeper(threading.Thread):
    """ZAP handler admitting the job's keys (each named by its owner), and logger of pre-ZAP
    rejections; :attr:`num_refused_keys` and :attr:`num_failed_handshakes` count them.

    ZeroMQ asks the ZAP handler about every CURVE peer that knows the server key; a peer that
    fails earlier (a plain client: mechanism mismatch) never reaches ZAP, so the sockets'
    monitor events are read here too, to log that rejection as well."""

    def __init__(self, ctx: zmq.Context, keys: ServerKeys) -> None:
        super().__init__(name="tiderl-bus-gatekeeper", daemon=True)
        self._ctx = ctx
        self._owners = {z85.decode(public): name.encode() for name, public in keys.peers.items()}
        self._zap = ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)  # bound before any server socket can see a peer
        stop_endpoint = f"inproc://tiderl-gatekeeper-stop-{id(self)}"
        self._stop_tx = ctx.socket(zmq.PAIR)
        self._stop_tx.bind(stop_endpoint)
        self._stop_rx = ctx.socket(zmq.PAIR)
        self._stop_rx.connect(stop_endpoint)
        self._monitors: dict[zmq.Socket, str] = {}
        self._throttle = LogThrottle(log)
        self.num_refused_keys = 0  # ZAP said no; both counters written by this thread only
        self.num_failed_handshakes = 0  # before ZAP (a plain peer), per connection attempt

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
        request_id, domain, address, mechanism = request[1], request[2], request[3], request[5]
        credentials = request[6:]
        owner = self._owners.get(credentials[0]) if mechanism == b"CURVE" and credentials \
            else None
        if owner is None:
            reason = (f"unknown CURVE key {z85.encode(credentials[0])[:8].decode()}…"
                      if mechanism == b"CURVE" and credentials
                      else f"mechanism {mechanism.decode(errors='replace')}")
        elif domain != ROUTER_DOMAIN and owner != OPERATOR.encode():
            reason, owner = f"{owner.decode()}'s key on the PUB, which serves the operator", None
        if owner is None:
            self.num_refused_keys += 1
            line = f"bus: rejected a peer from {address.decode(errors='replace')} ({reason})"
            self._throttle.warn(line, line)
        self._zap.send_multipart([b"1.0", request_id, b"400" if owner is None else b"200",
                                  b"not a key of this job" if owner is None else b"OK",
                                  owner or b"", b""])

    def _report(self, event: dict, endpoint: str) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            reason = f"{os.strerror(event['value'])}; a peer without CURVE?"
        elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            reason = "the peer does not use CURVE"
        else:
            reason = f"ZMTP protocol error {event['value']:#x}"
        self.num_failed_handshakes += 1
        line = f"bus: rejected a peer on {endpoint} (handshake failed: {reason})"
        self._throttle.warn(line, line)
