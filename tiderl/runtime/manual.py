"""Manual ERS plans over the bus: ``tiderl rebalance`` (client) and the coordinator's half.

    tiderl rebalance ──Rebalance──> Coordinator._handle ──checks──> RebalanceReply "refused"
                                                          └─ held as pending ─> "accepted"
    the next post-update boundary (_end_step) ── checks again, ``manual_plan`` ──>
        _boundary(roles, reason "manual") ──> RebalanceReply "applied"; the layout is held
    tiderl rebalance --auto ──Rebalance(auto)──> the hold ends: ERS plans from the next boundary

Invariant: at most one manual plan is pending (a newer one replaces it, the older requester hears
"refused"); while a manual layout is held, neither ERS nor (without ERS) RA2P's per-step mode
choice changes it. The rank choice is the core's (:func:`tiderl.core.ers.manual_plan`); the
runtime's own limits (process groups, the trainer backend) are ``LayoutMixin._layout_refusal``,
the same check ERS plans go through. A mixin of :class:`tiderl.runtime.coordinator.Coordinator`.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tiderl.core.ers import manual_plan, manual_refusal
from tiderl.core.types import Mode, ScalingPlan
from tiderl.runtime import bus as b
from tiderl.runtime.bus import BusClient, BusSendError, JobKeys

log = logging.getLogger("tiderl.coordinator")

HAND_BACK = "`tiderl rebalance JOB --auto` hands back to ERS"


@dataclass(frozen=True, slots=True)
class PendingRebalance:
    """An accepted request waiting for its boundary, and who to tell when it is applied."""

    identity: bytes
    request: b.Rebalance


def describe(msg: b.Rebalance, mode: str = "") -> str:
    """"R2/T1 colocated": the requested counts and mode, for events, notes and lines."""
    return f"R{msg.rollout}/T{msg.trainer}" + (f" {mode or msg.mode}" if mode or msg.mode else "")


class ManualMixin:
    def _init_manual(self) -> None:
        self.manual_pending: PendingRebalance | None = None
        self.manual_hold = False  # a manual layout runs; ERS waits for --auto

    # ---------------------------------------------------------------- requests

    def _on_rebalance(self, identity: bytes, msg: b.Rebalance) -> None:
        if msg.auto and not self.is_sync:
            self._release_manual(identity, msg)
            return
        result = self._check_manual(msg, is_request=True)
        if isinstance(result, str):
            self.event("rebalance_refused", reason=result, request=describe(msg), step=self.step)
            self._reply(identity, msg.seq, "refused", reason=result, step=self.step)
            return
        if self.manual_pending is not None:
            old = self.manual_pending
            why = f"replaced by a newer manual plan ({describe(msg)})"
            self.event("rebalance_refused", reason=why, request=describe(old.request),
                       step=self.step)
            self._reply(old.identity, old.request.seq, "refused", reason=why, step=self.step)
        self.manual_pending = PendingRebalance(identity, msg)
        roles = [role.value for role in self._planned_roles(result.changes)]
        self.event("rebalance_requested", request=describe(msg), mode=result.mode.value,
                   roles=roles, step=self.step)
        self.plan_note = (f"manual plan {describe(msg, result.mode.value)}: pending "
                          f"(next boundary, after step {self.step})")
        self._reply(identity, msg.seq, "accepted", step=self.step, roles=roles,
                    mode=result.mode.value)

    def _check_manual(self, msg: b.Rebalance, is_request: bool = False) -> ScalingPlan | str:
        """The plan for ``msg`` in the job as it is now, or why it cannot run (one line). A new
        request also needs a boundary before the last one (that one only saves a checkpoint)."""
        if self.is_sync:
            return "mode sync: every rank rolls out and trains"
        if is_request and self.step >= self.profile.runtime.steps - 1:
            return (f"the job is finishing: step {self.step} is its last "
                    "(no boundary is left to apply a plan at)")
        if msg.mode not in ("", *(m.value for m in Mode)):
            return f"unknown RA2P mode {msg.mode!r} (decoupled or colocated)"
        if msg.mode and self.mode != "tiderl":
            return (f"mode {self.mode} has no RA2P mode choice (only mode tiderl runs "
                    "decoupled or colocated): leave out --mode")
        mode = Mode(msg.mode) if msg.mode else None
        roles = tuple(self.roles)
        refusal = manual_refusal(roles, msg.rollout, msg.trainer, mode)
        if refusal is not None:
            return refusal
        plan = manual_plan(roles, msg.rollout, msg.trainer, mode, self.ra2p_mode,
                           self.batch_ideal)
        return self._layout_refusal(self._planned_roles(plan.changes)) or plan

    def _release_manual(self, identity: bytes, msg: b.Rebalance) -> None:
        """--auto: drop a pending plan and end the hold; ERS plans from the next boundary."""
        dropped = self.manual_pending
        if dropped is not None:
            self.manual_pending = None
            self._reply(dropped.identity, dropped.request.seq, "refused",
                        reason="withdrawn by --auto", step=self.step)
        was_held, self.manual_hold = self.manual_hold, False
        self.event("rebalance_auto", step=self.step, was_held=was_held,
                   dropped=describe(dropped.request) if dropped else None)
        if self.ers is not None:
            then = "ERS plans again from the next boundary"
        elif self.mode == "tiderl":
            then = "RA2P chooses the mode again from the next step"
        else:
            then = f"mode {self.mode} has no ERS: the layout stays as it is"
        self.plan_note = f"manual hold released at step {self.step}: {then}"
        self._reply(identity, msg.seq, "applied", reason=self.plan_note, step=self.step,
                    version=self.version, roles=[role.value for role in self.roles],
                    mode=self.ra2p_mode.value)

    # ---------------------------------------------------------------- the boundary

    def _apply_manual(self) -> bool:
        """At a post-update boundary (version ``self.version`` just made): the pending plan, if
        one is pending and still possible, is this boundary's. True if it sent the boundary."""
        pending, self.manual_pending = self.manual_pending, None
        if pending is None:
            return False
        msg, what = pending.request, describe(pending.request)
        result = self._check_manual(msg)
        if isinstance(result, str):  # the job changed since (a rank died, it is finishing)
            reason = f"at the boundary of version {self.version}: {result}"
            self.event("rebalance_refused", reason=reason, request=what, step=self.step)
            self.plan_note = f"manual plan {what}: refused {reason}"
            self._reply(pending.identity, msg.seq, "refused", reason=reason, step=self.step)
            return False
        roles = self._planned_roles(result.changes)
        self.ra2p_mode = result.mode
        self.last_plan_reason = result.reason.value
        self.manual_hold = True
        if self.ers is not None:
            self.ers.reset()  # its hysteresis and phase memory were about the old layout
        self._boundary(roles=roles, reason=result.reason.value)
        names = [role.value for role in roles]
        self.event("rebalance_applied", request=what, version=self.version, step=self.step,
                   roles=names, mode=result.mode.value)
        self.plan_note = (f"manual plan {describe(msg, result.mode.value)} applied at version "
                          f"{self.version} (held; {HAND_BACK})")
        self._reply(pending.identity, msg.seq, "applied", step=self.step, version=self.version,
                    roles=names, mode=result.mode.value)
        return True

    def _reply(self, identity: bytes, ref: int, status: str, **fields) -> None:
        try:
            self.server.send(identity, b.RebalanceReply(ref=ref, status=status, **fields))
        except BusSendError as exc:  # the requester left (--no-wait, or it timed out)
            log.info("rebalance: %s", exc)


# --------------------------------------------------------------------------- the client


def request_rebalance(endpoint: str, keys: JobKeys, request: b.Rebalance, *,
                      reply_timeout_s: float, apply_timeout_s: float,
                      wait: bool = True) -> Iterator[b.RebalanceReply | None]:
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


def _await_reply(client: BusClient, ref: int, timeout_s: float) -> b.RebalanceReply | None:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        msg = client.recv(left)
        if isinstance(msg, b.RebalanceReply) and msg.ref == ref:
            return msg
    return None
