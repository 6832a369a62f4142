"""A rank's death, as the step cycle takes it: what a death means (:func:`on_death`) and how the
step it died in ended (:func:`settle`), as data the controller applies.

    any rank dies ──LayoutLimits.loss_refusal──> STOP (Abort: the job stops, resumable) when the
        ranks left cannot go on: an actor under FSDP2 or megatron, the last actor that held
        the model, or ranks left without a process group; else, by what it was in:
    a step open on it ──> ABORT_STEP; the step's live ranks report how it ended (settle):
        every live actor updated (it died after the last collective) ──> TRAINED
        none did ──> RUN_AGAIN (attempt + 1, colocated, the same micro-batches), after a
                     boundary without an update (TRAINER_LOST) when an actor died
        some did ──> REPLICAS_DIFFER: Abort
    an actor, a boundary out ──> BOUNDARY_AGAIN: from its old layout without the dead rank
                                 (from a live actor of both layouts)
    an actor, a batch awaited ──> TRAINER_LOST: a boundary without an update
    an actor otherwise ──> NOTHING more (its boundary or step comes)
    a rollout or Ref rank ──> LEAVE: out of the layout (a boundary it was in completes
        without it); a rollout rank's tasks go back to CTB (LeaveRollout: from scratch), and
        with no rollout rank left the open batch closes with what it holds and the boundary
        after it moves a trainer rank to rollout (NO_ROLLOUT; a streaming step open on a batch
        with no group is aborted and runs again after that boundary)

A trainer rank's death is survivable when every actor holds the whole model and optimizer state
(DDP): the actors left hold the version the dead one held. The step it died in is trained once:
either every live actor finished it (the dead rank's gradients were in the reduction) or none
did, and it runs again.
"""

from __future__ import annotations

from enum import Enum

from tiderl.core.buffer import ReadyBuffer
from tiderl.core.commands import StepOutcome
from tiderl.core.ers import TRAINER_ROLES
from tiderl.core.step_control.config import LayoutLimits, StepControlError
from tiderl.core.step_control.state import CycleState, OpenStep, PendingBoundary, Phase, actors
from tiderl.core.system import SystemSpec


class Death(str, Enum):
    IGNORED = "ignored"  # not a live rank of the job, or the job is over
    STOP = "stop"
    ABORT_STEP = "abort_step"
    BOUNDARY_AGAIN = "boundary_again"
    TRAINER_LOST = "trainer_lost"
    NOTHING = "nothing"
    LEAVE = "leave"


class NoRollout(str, Enum):
    """What the cycle does when no rollout rank is left (:func:`rollout_left`)."""

    NOTHING = "nothing"  # a rollout rank is left, a boundary is in flight, or the batch is whole
    SHRINK = "shrink"  # the open batch closes with the groups it holds
    MOVE_NOW = "move_now"  # no group, no step open: a boundary moves a trainer rank now
    ABORT_STEP = "abort_step"  # no group, a step open on the batch: it is aborted, and runs
    #                            again once a boundary moved a trainer rank (MOVE_NOW then)


class Settlement(str, Enum):
    TRAINED = "trained"
    RUN_AGAIN = "run_again"
    REPLICAS_DIFFER = "replicas_differ"


def on_death(rank: int, why: str, state: CycleState, pending: PendingBoundary | None,
             current: OpenStep | None, limits: LayoutLimits, is_sync: bool) -> tuple[Death, str]:
    """What ``rank``'s death means now (see the module docstring), and for STOP why, in one
    line. Call before the rank is marked dead."""
    if rank in state.dead or not 0 <= rank < len(state.roles) or state.phase is Phase.FINISHED:
        return Death.IGNORED, ""
    before = pending.old_roles if pending is not None else ()
    in_play = actors(state.roles, is_sync) | actors(before, is_sync)
    is_actor = rank in in_play
    is_trainer = is_actor or state.roles[rank] in TRAINER_ROLES
    dead = state.dead | {rank}
    live = set(range(len(state.roles))) - dead
    holders = actors(state.roles, is_sync)
    if pending is not None and pending.old_roles:  # an actor before and after the boundary
        holders &= actors(pending.old_roles, is_sync)
    refusal = limits.loss_refusal(is_actor, holders - dead, live,
                                  actors(state.roles, is_sync) - dead)
    if refusal is not None:
        kind = "trainer rank" if is_trainer else "rank"
        return Death.STOP, f"{kind} {rank} is gone ({why}); it {refusal}"
    if current is not None and rank in current.start.ranks:
        return (Death.NOTHING if current.is_aborted else Death.ABORT_STEP), ""
    if is_actor:  # the actor set changes: DDP wraps the actors left
        if pending is not None:
            return Death.BOUNDARY_AGAIN, ""
        return (Death.TRAINER_LOST if state.phase is Phase.WAITING else Death.NOTHING), ""
    return Death.LEAVE, ""


def settle(current: OpenStep, outcome: StepOutcome, dead: set[int]) -> tuple[Settlement, str]:
    """Whether the open step trained, from its live ranks' reports; for REPLICAS_DIFFER why, in
    one line."""
    reports = [r for r in outcome.reports if r.rank not in dead]
    if not current.is_aborted:
        failed = [r.rank for r in reports if r.failed]
        if failed:  # the adapter waits for a death that explains a failure, or stops
            raise StepControlError(f"step {current.start.step}: ranks {failed} failed "
                                   "with every rank alive")
        return Settlement.TRAINED, ""
    actor_reports = [r for r in reports if r.rank in current.start.actor_ranks]
    updated = [r.rank for r in actor_reports if not r.failed]
    if len(updated) == len(actor_reports):
        return Settlement.TRAINED, ""  # the dead rank's part was in the reduction already
    if updated:
        return Settlement.REPLICAS_DIFFER, (
            f"step {current.start.step}: actors {updated} updated their weights and "
            f"{[r.rank for r in actor_reports if r.failed]} did not (a trainer rank died in "
            "the reduction): the replicas differ")
    return Settlement.RUN_AGAIN, ""


def rollout_left(state: CycleState, buffer: ReadyBuffer, current: OpenStep | None,
                 system: SystemSpec, has_rollout: bool) -> NoRollout:
    """No rollout rank is left: no group can come, so the open batch closes with the groups it
    holds (a smaller batch, as ERS's elastic one) and the boundary after its step moves a
    trainer rank to rollout. A batch with no group: with no step open, a boundary without an
    update moves the rank now; a step open on it (streaming) has nothing to train: it is
    aborted, its ranks report that none updated, and it runs again (attempt + 1) after that
    boundary. Checked again when a step opens while a boundary is in flight, and nothing to do
    once the step's batch is complete (the boundary after it moves a rank)."""
    if has_rollout or system.is_sync or state.phase in (Phase.BOUNDARY, Phase.FINISHED) \
            or buffer.open_batch != state.step:
        return NoRollout.NOTHING
    if buffer.assigned_samples:
        return NoRollout.SHRINK
    return NoRollout.MOVE_NOW if current is None else NoRollout.ABORT_STEP
