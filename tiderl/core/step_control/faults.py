"""A rank's death, as the step cycle takes it (mixed into the step controller).

    any rank dies ──LayoutLimits.loss_refusal──> Abort (the job stops, resumable) when the
        ranks left cannot go on: an actor under FSDP2 or megatron, the last actor that held
        the model, or ranks left without a process group; else, by what it was in:
    a step open on it ──> AbortStep; the step's live ranks report how it ended:
        every live actor updated (it died after the last collective) ──> the step is done
        none did ──> the step again (attempt + 1, colocated, the same micro-batches), after a
                     boundary without an update (TRAINER_LOST) when an actor died
        some did ──> the replicas differ: Abort
    an actor, a boundary out ──> that boundary again, from its old layout without the dead
                                 rank (from a live actor of both layouts)
    an actor, a batch awaited ──> a boundary without an update (TRAINER_LOST)
    a rollout or Ref rank ──> out of the layout (a broadcast it was in goes out again without
        it); a rollout rank's tasks go back to CTB (LeaveRollout: from scratch), and with no
        rollout rank left the open batch closes with what it holds and the boundary after it
        moves a trainer rank to rollout (NO_ROLLOUT)

A trainer rank's death is survivable when every actor holds the whole model and optimizer state
(DDP): the actors left hold the version the dead one held. The step it died in is trained once:
either every live actor finished it (the dead rank's gradients were in the reduction) or none
did, and it runs again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tiderl.core.buffer import ReadyBuffer
from tiderl.core.commands import (
    Abort,
    AbortStep,
    Command,
    LeaveRollout,
    StartStep,
    StepOutcome,
)
from tiderl.core.ctb import TaskBook
from tiderl.core.ers import TRAINER_ROLES
from tiderl.core.step_control.config import StepControlConfig, StepControlError
from tiderl.core.step_control.rollout import RolloutControl
from tiderl.core.step_control.state import OpenStep, PendingBoundary, Phase
from tiderl.core.system import StepMode, SystemSpec
from tiderl.core.types import PlanReason, Role


class RankFaults:
    """The step controller's handling of dead ranks. It uses these of the controller:"""

    config: StepControlConfig
    roles: list[Role]
    dead: set[int]
    step: int
    phase: Phase
    current: OpenStep | None
    boundary: PendingBoundary | None
    retry: OpenStep | None
    closed: set[int]
    buffer: ReadyBuffer
    rollout: RolloutControl
    _now: float
    _out: list[Command]
    system: SystemSpec
    book: TaskBook
    _at: Callable[[float], None]
    _flush: Callable[[], list[Command]]
    _boundary: Callable[..., None]
    _maybe_retire: Callable[[float], None]
    _maybe_complete: Callable[[float], None]
    _want_step: Callable[[float], None]
    _actors: Callable[[tuple[Role, ...]], set[int]]
    rollout_ranks: Callable[[], list[int]]

    def rank_dead(self, rank: int, why: str, now: float) -> list[Command]:
        """A rank is gone (see the module docstring)."""
        self._at(now)
        if rank in self.dead or not 0 <= rank < len(self.roles) \
                or self.phase is Phase.FINISHED:
            return []
        was_actor = rank in self._actors_in_play()
        was_trainer = was_actor or self.roles[rank] in TRAINER_ROLES
        self.dead.add(rank)
        live = set(range(len(self.roles))) - self.dead
        refusal = self.config.limits.loss_refusal(
            was_actor, self._holders(), live, self._actors(tuple(self.roles)) - self.dead)
        if refusal is not None:
            kind = "trainer rank" if was_trainer else "rank"
            self._out.append(Abort(f"{kind} {rank} is gone ({why}); it {refusal}"))
            return self._flush()
        if rank in self.book.ranks:
            self._out.append(LeaveRollout(rank, self.rollout.remove_rank(rank, now), True))
        self.roles[rank] = Role.IDLE
        current = self.current
        if current is not None and rank in current.start.ranks:
            if not current.is_aborted:
                current.is_aborted = True  # what the buffer forms now waits for the next attempt
                self._out.append(AbortStep(current.start.step, current.start.attempt))
            return self._flush()  # the step's live ranks report (settle_step)
        if was_actor:  # the actor set changes: DDP wraps the actors left
            if self.boundary is not None:
                self._boundary_again(now)
            elif self.phase is Phase.WAITING:
                self.phase = Phase.BOUNDARY
                self._boundary(now, self.roles, PlanReason.TRAINER_LOST)
            return self._flush()
        if self.boundary is not None:  # the broadcast it was in goes out again without it
            self.boundary.forget(rank)
        self._maybe_retire(now)
        self._maybe_complete(now)
        self._check_rollout_left(rank)
        return self._flush()

    def _actors_in_play(self) -> set[int]:
        """The actors now and, while a boundary is out, before it."""
        before = self.boundary.old_roles if self.boundary is not None else ()
        return self._actors(tuple(self.roles)) | self._actors(tuple(before))

    def _holders(self) -> set[int]:
        """The live actors that hold the model and its optimizer state for certain: while a
        boundary is out, those that are actors before and after it (one that leaves drops its
        model when it takes the boundary, one that joins has it only once it took it)."""
        actors = self._actors(tuple(self.roles))
        if self.boundary is not None and self.boundary.old_roles:
            actors &= self._actors(self.boundary.old_roles)
        return actors - self.dead

    def _boundary_again(self, now: float) -> None:
        """The boundary out, sent again from the layout before it with the dead ranks left out
        (and so from a live source: an actor before and after it, ``_holders``)."""
        pending = self.boundary
        assert pending is not None and pending.old_roles
        self.roles, new = [Role.IDLE if r in self.dead else role
                           for r, role in enumerate(pending.old_roles)], list(self.roles)
        self._boundary(now, new, pending.reason, is_resume=pending.is_resume)

    def settle_step(self, current: OpenStep, outcome: StepOutcome, now: float) -> bool:
        """Whether the open step trained, from its live ranks' reports; when it did not, the
        step runs again or the job stops."""
        reports = [r for r in outcome.reports if r.rank not in self.dead]
        if not current.is_aborted:
            failed = [r.rank for r in reports if r.failed]
            if failed:  # the adapter waits for a death that explains a failure, or stops
                raise StepControlError(f"step {current.start.step}: ranks {failed} failed "
                                       "with every rank alive")
            return True
        actors = [r for r in reports if r.rank in current.start.actor_ranks]
        updated = [r.rank for r in actors if not r.failed]
        if len(updated) == len(actors):
            return True  # the dead rank's part was in the reduction already
        if updated:
            self._out.append(Abort(
                f"step {current.start.step}: actors {updated} updated their weights and "
                f"{[r.rank for r in actors if r.failed]} did not (a trainer rank died in the "
                "reduction): the replicas differ"))
            return False
        self._run_again(current, now)
        return False

    def _run_again(self, current: OpenStep, now: float) -> None:
        """No live actor updated: the step opens again with the micro-batches it had
        (``_open_step``), after a boundary without an update when an actor died (the ranks left
        wrap their new actor set)."""
        self.current = None
        self.retry = current
        if current.is_closed:
            self.closed.add(current.start.step)
        if set(current.start.actor_ranks) <= self._actors(tuple(self.roles)):  # a Ref died
            self.phase = Phase.WAITING
            self._want_step(now)
            return
        self.phase = Phase.BOUNDARY
        self._boundary(now, self.roles, PlanReason.TRAINER_LOST)

    def _retry_start(self, start: StartStep, retry: OpenStep) -> StartStep:
        """The step again: colocated on its actors (a Ref rank's messages of the failed attempt
        may still wait in the actors' queues), the next attempt."""
        if start.mode is StepMode.DECOUPLED:
            start = replace(start, mode=StepMode.COLOCATED, ref_ranks=(),
                            max_aggregate=self.config.ra2p.max_aggregate)
        return replace(start, attempt=retry.start.attempt + 1)

    def _check_rollout_left(self, last: int) -> None:
        """No rollout rank is left (``last`` was the last; -1: not known here): no group can
        come, so the open batch closes with the groups it holds (a smaller batch, as ERS's
        elastic one) and the boundary after its step moves a trainer rank to rollout
        (:meth:`_boundary`). A batch with no group: with no step open, a boundary without an
        update moves the rank now; a step open on it cannot train, and the job stops (it
        resumes from its last checkpoint)."""
        if self.rollout_ranks() or self.system.is_sync or self.phase in (Phase.BOUNDARY,
                                                                          Phase.FINISHED):
            return  # a boundary in flight: checked again when the step opens (_want_step)
        buffer = self.buffer
        if buffer.open_batch != self.step:
            return  # the step's batch is complete already; the boundary after it moves a rank
        held = buffer.assigned_samples
        if held:
            buffer.set_batch_size(self.step, held, self._now)
        elif self.current is None:
            self.phase = Phase.BOUNDARY
            self._boundary(self._now, self.roles, PlanReason.NO_ROLLOUT)
        else:
            which = f" (rank {last} was the last)" if last >= 0 else ""
            self._out.append(Abort(f"no rollout rank is left{which} and step {self.step} is "
                                   f"open on a batch with no group"))
