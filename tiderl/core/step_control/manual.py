"""Operator plans (``tiderl rebalance``): whether one can run in the job as it is now.

The rank choice is ERS's (:func:`tiderl.core.ers.manual_plan`); the controller holds a pending
plan until the next post-update boundary, checks it again there, and then holds its layout:
neither ERS nor (without ERS) RA2P's per-step choice changes it until a release.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tiderl.core.commands import Command, ManualReply, ManualRequest
from tiderl.core.ers import ERSPolicy
from tiderl.core.ers_manual import manual_plan, manual_refusal
from tiderl.core.step_control.config import LayoutLimits, StepControlConfig
from tiderl.core.system import System, SystemSpec
from tiderl.core.types import Mode, PlanReason, Role, RoleChange, ScalingPlan

SYNC_REFUSAL = "mode sync: every rank rolls out and trains"
WITHDRAWN = "withdrawn by --auto"


def planned_roles(roles: Sequence[Role], changes: Sequence[RoleChange]) -> list[Role]:
    """``roles`` after a plan's ``changes``."""
    new = list(roles)
    for change in changes:
        new[change.rank] = change.dst
    return new


def check_manual(request: ManualRequest, *, system: SystemSpec, step: int, num_steps: int,
                 roles: Sequence[Role], ra2p_mode: Mode, batch_ideal: int, limits: LayoutLimits,
                 is_request: bool) -> ScalingPlan | str:
    """The plan for ``request``, or why it cannot run (one line). A new request also needs a
    boundary before the last one (that one only saves)."""
    if system.is_sync:
        return SYNC_REFUSAL
    if is_request and step >= num_steps - 1:
        return (f"the job is finishing: step {step} is its last "
                "(no boundary is left to apply a plan at)")
    if request.mode is not None and system.system is not System.TIDERL:
        return (f"mode {system.system.value} has no RA2P mode choice (only mode tiderl runs "
                "decoupled or colocated): leave out --mode")
    refusal = manual_refusal(tuple(roles), request.rollout, request.trainer, request.mode)
    if refusal is not None:
        return refusal
    plan = manual_plan(tuple(roles), request.rollout, request.trainer, request.mode, ra2p_mode,
                       batch_ideal)
    return limits.refusal(list(roles), planned_roles(roles, plan.changes)) or plan


def after_release(system: SystemSpec, has_ers: bool) -> str:
    """What chooses the layout once a hold ends."""
    if has_ers:
        return "ERS plans again from the next boundary"
    if system.system is System.TIDERL:
        return "RA2P chooses the mode again from the next step"
    return f"mode {system.system.value} has no ERS: the layout stays as it is"


class ManualPlans:
    """The step controller's operator plans, mixed into :class:`StepController`: a request is
    refused, or pending until the next post-update boundary (a newer one replaces it); there it
    is checked again, applied and held until a release. It uses these of the controller:"""

    config: StepControlConfig
    roles: list[Role]
    step: int
    version: int
    ra2p_mode: Mode
    batch_ideal: int
    ers: ERSPolicy | None
    plan_reason: PlanReason | None
    manual_pending: tuple[ManualRequest, ScalingPlan] | None
    is_manual_held: bool
    _out: list[Command]
    system: SystemSpec
    _at: Callable[[float], None]
    _flush: Callable[[], list[Command]]
    _planned: Callable[[tuple[RoleChange, ...]], list[Role]]
    _boundary: Callable[[float, list[Role], PlanReason | None], None]

    def submit_manual(self, request: ManualRequest, now: float) -> list[Command]:
        """An operator's layout: refused, or pending until the next post-update boundary (a
        newer request replaces it)."""
        self._at(now)
        result = self._check_manual(request, is_request=True)
        if isinstance(result, str):
            self._out.append(ManualReply(request, request.key, "refused", self.step,
                                         reason=result))
            return self._flush()
        if self.manual_pending is not None:
            old = self.manual_pending[0]
            why = f"replaced by a newer manual plan ({request.describe()})"
            self._out.append(ManualReply(old, old.key, "refused", self.step, reason=why))
        self.manual_pending = (request, result)
        self._out.append(ManualReply(request, request.key, "accepted", self.step,
                                     roles=tuple(self._planned(result.changes)),
                                     mode=result.mode))
        return self._flush()

    def release_manual(self, key: object, now: float) -> list[Command]:
        """``--auto``: drop a pending plan and end the hold."""
        self._at(now)
        if self.system.is_sync:
            self._out.append(ManualReply(None, key, "refused", self.step,
                                         reason=SYNC_REFUSAL))
            return self._flush()
        dropped, self.manual_pending = self.manual_pending, None
        if dropped is not None:
            self._out.append(ManualReply(dropped[0], dropped[0].key, "refused", self.step,
                                         reason=WITHDRAWN))
        was_held, self.is_manual_held = self.is_manual_held, False
        if was_held and self.ers is None:
            self.plan_reason = None  # no plan lays the next steps out
        then = after_release(self.system, self.ers is not None)
        self._out.append(ManualReply(dropped[0] if dropped else None, key, "released",
                                     self.step, reason=then, version=self.version,
                                     roles=tuple(self.roles), mode=self.ra2p_mode,
                                     was_held=was_held))
        return self._flush()

    def _check_manual(self, request: ManualRequest, is_request: bool = False
                      ) -> ScalingPlan | str:
        return check_manual(request, system=self.system, step=self.step,
                            num_steps=self.config.num_steps, roles=self.roles,
                            ra2p_mode=self.ra2p_mode, batch_ideal=self.batch_ideal,
                            limits=self.config.limits, is_request=is_request)

    def _apply_manual(self, now: float) -> bool:
        """At a post-update boundary: the pending plan, checked again, is its boundary (and then
        held). True if it sent the boundary."""
        pending, self.manual_pending = self.manual_pending, None
        if pending is None:
            return False
        request = pending[0]
        result = self._check_manual(request)
        if isinstance(result, str):  # the job changed since (a rank died)
            reason = f"at the boundary of version {self.version}: {result}"
            self._out.append(ManualReply(request, request.key, "refused", self.step,
                                         reason=reason, is_at_boundary=True))
            return False
        roles = self._planned(result.changes)
        self.ra2p_mode, self.plan_reason = result.mode, result.reason
        self.is_manual_held = True
        if self.ers is not None:
            self.ers.reset()  # its hysteresis and phase memory were about the old layout
        self._boundary(now, roles, result.reason)
        self._out.append(ManualReply(request, request.key, "applied", self.step,
                                     version=self.version, roles=tuple(roles),
                                     mode=result.mode, is_at_boundary=True))
        return True
