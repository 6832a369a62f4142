"""The client of a manual ERS plan (``tiderl rebalance``): a DEALER on the job's bus.

    Rebalance ──> the coordinator (:mod:`tiderl.runtime.rebalance`)
              <── RebalanceReply "refused" | "accepted" (| "applied" for --auto)
              <── after "accepted", at the next boundary: "applied" | "refused"

The operator's CURVE key proves the request is the operator's (the bus server takes a Rebalance
from that key only); the identity (``ctl-<pid>-<random>``) is where the answers go, so several
requests at once each hear their own.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator

from tiderl.runtime.bus import BusClient, JobKeys, Rebalance, RebalanceReply


def request_rebalance(endpoint: str, keys: JobKeys, request: Rebalance, *,
                      reply_timeout_s: float, apply_timeout_s: float,
                      wait: bool = True) -> Iterator[RebalanceReply | None]:
    """Send ``request`` as a CLI peer and yield the coordinator's answers: the first (refused,
    accepted, or for --auto applied), then, if accepted and ``wait``, the final one (applied or
    refused). ``None`` is yielded for an answer that did not come in its timeout, and ends it."""
    identity = f"ctl-{os.getpid()}-{secrets.token_hex(4)}".encode()
    with BusClient(endpoint, keys, identity) as client:
        client.send(request)
        reply = _await_reply(client, request.seq, reply_timeout_s)
        yield reply
        if reply is not None and reply.status == "accepted" and wait:
            yield _await_reply(client, request.seq, apply_timeout_s)


def _await_reply(client: BusClient, ref: int, timeout_s: float) -> RebalanceReply | None:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        msg = client.recv(left)
        if isinstance(msg, RebalanceReply) and msg.ref == ref:
            return msg
    return None
