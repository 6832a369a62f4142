"""Manual ERS plans over the bus: ``tiderl rebalance``'s requests and the coordinator's answers
(the client is :mod:`tiderl.launch.rebalance`).

    Rebalance (a CLI peer) ──parse──> StepController.submit_manual | release_manual
    ManualReply commands ──> RebalanceReply to the requester, an event, the note ``top`` shows
        accepted ──(the next post-update boundary)──> applied | refused (checked again there)
        released (--auto) ──> "applied" with what chooses the layout from now on

Which plans run, and when, is the step controller's (:mod:`tiderl.core.step_control.manual`);
this desk turns bus requests into its requests and its replies into words.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tiderl.core.commands import Command, ManualReply, ManualRequest
from tiderl.core.quote import cut, short
from tiderl.core.step_control import StepController
from tiderl.core.step_control.manual import WITHDRAWN
from tiderl.core.types import Placement
from tiderl.runtime import bus as b
from tiderl.runtime.bus import BusSendError, BusServer

log = logging.getLogger("tiderl.coordinator")

HAND_BACK = "`tiderl rebalance JOB --auto` hands back to ERS"


class RebalanceDesk:
    def __init__(self, server: BusServer, event: Callable[..., None]) -> None:
        self.server, self.event = server, event
        self.note = ""  # a pending or the last manual plan, for top

    def request(self, identity: bytes, msg: b.Rebalance, controller: StepController,
                now: float) -> list[Command]:
        """The controller's commands for a request (the replies among them are this desk's)."""
        key = (identity, msg.seq)
        if msg.auto:
            return controller.release_manual(key, now)
        if msg.placement not in ("", *(m.value for m in Placement)):
            reason = f"unknown RA2P placement {short(msg.placement)} (decoupled or colocated)"
            self.event("rebalance_refused", reason=reason, request=_describe(msg),
                       step=controller.state.step)
            self._reply(key, "refused", reason=reason, step=controller.state.step)
            return []
        placement = Placement(msg.placement) if msg.placement else None
        return controller.submit_manual(ManualRequest(key, msg.rollout, msg.trainer, placement),
                                        now)

    def deliver(self, reply: ManualReply) -> None:
        roles = [role.value for role in reply.roles]
        placement = reply.placement.value if reply.placement is not None else ""
        request = reply.request
        if reply.status == "released":
            self.event("rebalance_auto", step=reply.step, was_held=reply.was_held,
                       dropped=request.describe() if request is not None else None)
            self.note = f"manual hold released at step {reply.step}: {reply.reason}"
            self._reply(reply.key, "applied", reason=self.note, step=reply.step,
                        version=reply.version, roles=roles, placement=placement)
            return
        what = request.describe() if request is not None else "--auto"
        if request is not None and reply.status == "accepted":
            self.event("rebalance_requested", request=what, placement=placement, roles=roles,
                       step=reply.step)
            self.note = (f"manual plan {request.describe(reply.placement)}: pending (next "
                         f"boundary, after step {reply.step})")
        elif request is not None and reply.status == "applied":
            self.event("rebalance_applied", request=what, version=reply.version,
                       step=reply.step, roles=roles, placement=placement)
            self.note = (f"manual plan {request.describe(reply.placement)} applied at version "
                         f"{reply.version} (held; {HAND_BACK})")
        elif reply.reason != WITHDRAWN:  # refused: the --auto that withdrew it says so
            self.event("rebalance_refused", reason=reply.reason, request=what, step=reply.step)
            if reply.is_at_boundary:
                self.note = f"manual plan {what}: refused {reply.reason}"
        self._reply(reply.key, reply.status, reason=reply.reason, step=reply.step,
                    version=reply.version, roles=roles, placement=placement)

    def _reply(self, key: object, status: str, **fields: object) -> None:
        identity, ref = key
        try:
            self.server.send(identity, b.RebalanceReply(ref=ref, status=status, **fields))
        except BusSendError as exc:  # the requester left (--no-wait, or it timed out)
            log.info("rebalance: %s", exc)


def _describe(msg: b.Rebalance) -> str:
    return f"R{msg.rollout}/T{msg.trainer}" + (f" {cut(msg.placement)}" if msg.placement else "")
