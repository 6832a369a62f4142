"""Manual plans: ``tiderl rebalance --rollout N --trainer M [--placement]`` as an ERS plan (reason
MANUAL). The operator gives the counts, these functions pick the ranks; the step controller holds
the plan (``step_control.manual``) and ERS plans again after a release.

Ranks stay in place where they can; leaving the trainer: surplus Ref ranks first, then actors,
highest id first; joining it: the highest rollout ranks. Colocated: every trainer rank is an
actor; decoupled: exactly one is a Ref (a Ref already there, else a joining rank, else the highest
actor). The lowest actor always keeps its role, so the weights have a source.
"""

from __future__ import annotations

from tiderl.core.ers import TRAINER_ROLES, ranks_with
from tiderl.core.types import Placement, PlanReason, Role, RoleChange, ScalingPlan


def manual_refusal(
    roles: tuple[Role, ...], num_rollout: int, num_trainer: int, placement: Placement | None
) -> str | None:
    """Why ``manual_plan`` cannot form this layout from ``roles``, in one line; None if it can.
    IDLE (dead) ranks do not count: the counts must add up to the live ranks."""
    num_live = sum(1 for role in roles if role is not Role.IDLE)
    if num_rollout < 1:
        return f"--rollout {num_rollout}: at least one rollout rank is needed"
    if num_trainer < 1:
        return f"--trainer {num_trainer}: at least one trainer rank is needed"
    if num_rollout + num_trainer != num_live:
        return (f"--rollout {num_rollout} + --trainer {num_trainer} = "
                f"{num_rollout + num_trainer}, but the job has {num_live} live ranks")
    if placement is Placement.DECOUPLED and num_trainer < 2:
        return (f"decoupled needs at least 2 trainer ranks (a Ref and an Actor), "
                f"got --trainer {num_trainer}")
    if Role.ACTOR not in roles:
        return "no actor rank is left to hold the weights"
    return None


def manual_placement(requested: Placement | None, current: Placement,
                     num_trainer: int) -> Placement:
    """The requested placement, else the current one where the trainer can run it."""
    if requested is not None:
        return requested
    return current if num_trainer >= 2 else Placement.COLOCATED


def _manual_trainer_set(roles: tuple[Role, ...], num_trainer: int, keep_refs: int) -> set[int]:
    current = [r for r, role in enumerate(roles) if role in TRAINER_ROLES]
    if num_trainer >= len(current):
        joining = ranks_with(roles, Role.ROLLOUT)[: num_trainer - len(current)]
        return {*current, *joining}
    refs = ranks_with(roles, Role.REF)
    num_surplus = max(0, len(refs) - keep_refs)
    leaving = [*refs[:num_surplus], *ranks_with(roles, Role.ACTOR), *refs[num_surplus:]]
    return set(current) - set(leaving[: len(current) - num_trainer])


def _manual_ref(roles: tuple[Role, ...], trainer: set[int]) -> int:
    """The decoupled plan's Ref rank (``trainer`` holds at least two ranks)."""
    for role in (Role.REF, Role.ROLLOUT, Role.ACTOR):
        ranks = [r for r in sorted(trainer) if roles[r] is role]
        if ranks:
            return ranks[0] if role is Role.REF else ranks[-1]
    raise ValueError("an empty trainer set")


def manual_plan(
    roles: tuple[Role, ...],
    num_rollout: int,
    num_trainer: int,
    placement: Placement | None,
    current_placement: Placement,
    batch_size: int,
) -> ScalingPlan:
    """The operator's layout as a plan (reason MANUAL); ``placement`` None keeps
    ``current_placement`` where it can (see ``manual_placement``). ValueError with
    ``manual_refusal``'s line if refused."""
    refusal = manual_refusal(roles, num_rollout, num_trainer, placement)
    if refusal is not None:
        raise ValueError(refusal)
    placement = manual_placement(placement, current_placement, num_trainer)
    trainer = _manual_trainer_set(roles, num_trainer, 1 if placement is Placement.DECOUPLED else 0)
    target = [role if role is Role.IDLE or r in trainer else Role.ROLLOUT
              for r, role in enumerate(roles)]
    for rank in trainer:
        target[rank] = Role.ACTOR
    if placement is Placement.DECOUPLED:
        target[_manual_ref(roles, trainer)] = Role.REF
    changes = tuple(RoleChange(rank, old, new)
                    for rank, (old, new) in enumerate(zip(roles, target, strict=True))
                    if old is not new)
    return ScalingPlan(changes, placement, batch_size, PlanReason.MANUAL)
