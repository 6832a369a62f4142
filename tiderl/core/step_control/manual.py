"""Operator plans (``tiderl rebalance``): whether one can run in the job as it is now, and the
hold it puts on the layout.

    submit ──refused (one line) | pending──> the next post-update boundary: checked again ──>
        refused (the job changed: a rank died) | applied: its boundary, then held ──release──>
        ERS (or, without it, RA2P's per-step choice) lays the steps out again

The rank choice is ERS's (:func:`tiderl.core.ers_manual.manual_plan`); a newer request replaces
a pending one; while a layout is held neither ERS nor RA2P's per-step choice changes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.core.commands import ManualReply, ManualRequest
from tiderl.core.ers_manual import manual_plan, manual_refusal
from tiderl.core.step_control.config import StepControlConfig
from tiderl.core.step_control.state import CycleState
from tiderl.core.system import System, SystemSpec
from tiderl.core.types import Placement, Role, RoleChange, ScalingPlan

SYNC_REFUSAL = "system sync: every rank rolls out and trains"
WITHDRAWN = "withdrawn by --auto"


def planned_roles(roles: Sequence[Role], changes: Sequence[RoleChange]) -> list[Role]:
    """``roles`` after a plan's ``changes``."""
    new = list(roles)
    for change in changes:
        new[change.rank] = change.dst
    return new


def check_manual(request: ManualRequest, config: StepControlConfig, *, step: int,
                 roles: Sequence[Role], placement: Placement,
                 is_request: bool) -> ScalingPlan | str:
    """The plan for ``request``, or why it cannot run (one line). A new request also needs a
    boundary before the last one (that one only saves)."""
    system = config.system
    if system.is_sync:
        return SYNC_REFUSAL
    if is_request and step >= config.job.steps - 1:
        return (f"the job is finishing: step {step} is its last "
                "(no boundary is left to apply a plan at)")
    if request.placement is not None and system.system is not System.TIDERL:
        return (f"system {system.system.value} has no RA2P placement (only system tiderl runs "
                "decoupled or colocated): leave out --placement")
    refusal = manual_refusal(tuple(roles), request.rollout, request.trainer, request.placement)
    if refusal is not None:
        return refusal
    plan = manual_plan(tuple(roles), request.rollout, request.trainer, request.placement,
                       placement,
                       config.job.batch_ideal)
    return config.limits.refusal(list(roles), planned_roles(roles, plan.changes)) or plan


def after_release(system: SystemSpec, has_ers: bool) -> str:
    """What chooses the layout once a hold ends."""
    if has_ers:
        return "ERS plans again from the next boundary"
    if system.system is System.TIDERL:
        return "RA2P chooses the placement again from the next step"
    return f"system {system.system.value} has no ERS: the layout stays as it is"


@dataclass
class ManualPlans:
    """The request waiting for the next post-update boundary, and whether an operator's
    layout is held."""

    pending: tuple[ManualRequest, ScalingPlan] | None = None
    is_held: bool = False

    def submit(self, request: ManualRequest, config: StepControlConfig,
               state: CycleState) -> list[ManualReply]:
        """Refused, or pending until the next post-update boundary (replacing an older one)."""
        result = check_manual(request, config, step=state.step, roles=state.roles,
                              placement=state.placement, is_request=True)
        if isinstance(result, str):
            return [ManualReply(request, request.key, "refused", state.step, reason=result)]
        replies = []
        if self.pending is not None:
            old = self.pending[0]
            why = f"replaced by a newer manual plan ({request.describe()})"
            replies.append(ManualReply(old, old.key, "refused", state.step, reason=why))
        self.pending = (request, result)
        replies.append(ManualReply(request, request.key, "accepted", state.step,
                                   roles=tuple(planned_roles(state.roles, result.changes)),
                                   placement=result.placement))
        return replies

    def release(self, key: object, config: StepControlConfig,
                state: CycleState) -> list[ManualReply]:
        """``--auto``: drop a pending plan and end the hold."""
        if config.system.is_sync:
            return [ManualReply(None, key, "refused", state.step, reason=SYNC_REFUSAL)]
        dropped, self.pending = self.pending, None
        replies = []
        if dropped is not None:
            replies.append(ManualReply(dropped[0], dropped[0].key, "refused", state.step,
                                       reason=WITHDRAWN))
        was_held, self.is_held = self.is_held, False
        if was_held and not config.has_ers:
            state.plan_reason = None  # no plan lays the next steps out
        replies.append(ManualReply(dropped[0] if dropped else None, key, "released",
                                   state.step, reason=after_release(config.system,
                                                                    config.has_ers),
                                   version=state.version, roles=tuple(state.roles),
                                   placement=state.placement, was_held=was_held))
        return replies

    def take(self, config: StepControlConfig, state: CycleState
             ) -> tuple[tuple[ManualRequest, ScalingPlan] | None, list[ManualReply]]:
        """At a post-update boundary: the pending request and its plan, checked again and held
        from now on; None, with a refusal, when the job changed since (a rank died)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None, []
        request = pending[0]
        result = check_manual(request, config, step=state.step, roles=state.roles,
                              placement=state.placement, is_request=False)
        if isinstance(result, str):
            reason = f"at the boundary of version {state.version}: {result}"
            return None, [ManualReply(request, request.key, "refused", state.step,
                                      reason=reason, is_at_boundary=True)]
        self.is_held = True
        return (request, result), []
