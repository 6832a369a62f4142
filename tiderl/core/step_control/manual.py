"""Operator plans (``tiderl rebalance``): whether one can run in the job as it is now.

The rank choice is ERS's (:func:`tiderl.core.ers.manual_plan`); the controller holds a pending
plan until the next post-update boundary, checks it again there, and then holds its layout:
neither ERS nor (without ERS) RA2P's per-step choice changes it until a release.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiderl.core.commands import ManualRequest
from tiderl.core.ers_manual import manual_plan, manual_refusal
from tiderl.core.step_control.config import LayoutLimits
from tiderl.core.system import System, SystemSpec
from tiderl.core.types import Mode, Role, RoleChange, ScalingPlan

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
