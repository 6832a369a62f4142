"""The step cycle of a replay (``runtime.replay``): a recording's steps trained again in order,
each on its recorded micro-batches in their recorded order and on its recorded layout, with no
rollout, no ERS plan and no RA2P choice (the recording holds what they chose).

    launch ──> step s is due (``load``) ──its recorded layout (its actor and Ref ranks, every
        other rank idle) differs from the roles──> Boundary (version s: the roles, the weights
        from an actor, AdamW state to a new actor) ──every member acknowledged──┐
                                    └──the same roles──────────────────────────┴──>
        StartStep, a Dispatch per recorded micro-batch, CloseStep ──StepOutcome──>
        RecordStep (the recorded loss beside the new one) ──> step s + 1 is due
    after the last step: Boundary (final: the export of the replayed weights), Finish

To its adapter a :class:`ReplayController` is a :class:`StepController`: the coordinator sends
it the same events and applies the same commands, and it keeps the same parts (the cycle's
state, the boundary out, the open step, the ledger), while rollout, the buffer and ERS stay
idle. It writes no checkpoint. A rank's death stops the job (a replay runs its recording's
layout or nothing), and an operator's plan is refused.

Invariant: step s runs on the ranks, step mode, ``max_aggregate`` and micro-batches its
recording has, from the weights the replay of steps 0..s-1 made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from tiderl.core.commands import (
    Abort,
    Boundary,
    CloseStep,
    Command,
    Finish,
    GroupSpec,
    ManualReply,
    ManualRequest,
    RecordStep,
    StartStep,
    StepOutcome,
)
from tiderl.core.step_control.config import StepControlConfig, StepControlError
from tiderl.core.step_control.controller import StepController
from tiderl.core.step_control.state import PendingBoundary, Phase, actors
from tiderl.core.types import Group, MicroBatch, Role

REFUSAL = "a replay runs the layout of its recording"


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """A recorded step as the replay runs it: its start (mode, ranks, ``max_aggregate``), its
    micro-batches in dispatch order, its groups and GRPO samples, and the loss its recording
    has (None: it did not train there)."""

    start: StartStep
    micro_batches: tuple[MicroBatch, ...]
    group_ids: frozenset[str]
    num_samples: int
    recorded_loss: float | None


def replay_roles(start: StartStep, num_ranks: int, is_sync: bool) -> list[Role]:
    """The layout step ``start`` ran on: its actor and Ref ranks, every other rank idle (under a
    synchronous system each rank of the step rolls out and trains, as it did there)."""
    if is_sync:
        return [Role.ROLLOUT if r in start.actor_ranks else Role.IDLE for r in range(num_ranks)]
    return [Role.ACTOR if r in start.actor_ranks else Role.REF if r in start.ref_ranks
            else Role.IDLE for r in range(num_ranks)]


class ReplayController(StepController):
    """See the module docstring. ``load`` gives recorded step ``s`` when it is due (the
    adapter's: it reads the recording and keeps the samples its Dispatches name)."""

    def __init__(self, config: StepControlConfig, roles: list[Role],
                 source: Callable[[GroupSpec], Group], load: Callable[[int], ReplayStep],
                 now: float = 0.0) -> None:
        super().__init__(config, roles, source, now)
        self.load = load
        self.due: ReplayStep | None = None  # the step whose layout is out, or that is open

    def launch(self, now: float) -> list[Command]:
        st = self.state
        st.t0 = st.trainer_free_at = now
        self.tracker.start_step(now)
        st.to(Phase.BOUNDARY)
        return self._lay_out(now)

    def step_done(self, outcome: StepOutcome, now: float) -> list[Command]:
        """The open step trained: its record (with the recorded loss), then the next step."""
        st, current, due = self.state, self.steps.current, self.due
        if st.phase is not Phase.TRAINING or current is None or due is None \
                or outcome.step != current.start.step:
            raise StepControlError(f"step {outcome.step} is not the open step")
        st.to(Phase.BOUNDARY)
        failed = [r.rank for r in outcome.reports if r.failed]
        if failed:
            return [Abort(f"step {st.step} failed on ranks {failed}")]
        outcome = replace(outcome, recorded_loss=due.recorded_loss)
        record = self.ledger.record(current, outcome, now, state=st, rollout=self.rollout,
                                    buffer=self.buffer, tprm_s=None, num_rollout=0)
        count, num_groups = self.feed.count, len(current.group_ids)
        count.fed, count.ready = count.fed + num_groups, count.ready + num_groups
        count.trained_ids |= current.group_ids
        self.steps.current = None
        st.updated(now)
        out: list[Command] = [RecordStep(record)]
        if st.step < self.config.job.steps:
            return out + self._lay_out(now)
        out += self._boundary_to(st.roles, is_final=True)
        st.to(Phase.FINISHED)
        return [*out, Finish(st.step)]

    def boundary_acked(self, rank: int, version: int, now: float) -> list[Command]:
        if self.boundaries.acknowledge(rank, version) is None or not self.boundaries.complete():
            return []
        return self._open(now)

    def rank_dead(self, rank: int, why: str, now: float) -> list[Command]:
        self.state.dead.add(rank)
        return [Abort(f"rank {rank} is gone ({why}): {REFUSAL}, on every rank")]

    def submit_manual(self, request: ManualRequest, now: float) -> list[ManualReply]:
        return [ManualReply(request, request.key, "refused", self.state.step, reason=REFUSAL)]

    def release_manual(self, key: object, now: float) -> list[ManualReply]:
        return [ManualReply(None, key, "refused", self.state.step, reason=REFUSAL)]

    # ------------------------------------------------------------------ the cycle

    def _lay_out(self, now: float) -> list[Command]:
        """Step ``step`` is due: a boundary to its layout first if the roles differ from it,
        else it opens now."""
        st = self.state
        self.due = self.load(st.step)
        roles = replay_roles(self.due.start, len(st.roles), self.config.system.is_sync)
        return self._open(now) if roles == st.roles else self._boundary_to(roles)

    def _boundary_to(self, roles: list[Role], is_final: bool = False) -> list[Command]:
        """The boundary to ``roles`` with the weights of this version, from an actor that stays
        one (else from one that does not: a replay's steps need not share an actor), the new
        actors getting the AdamW state too; no checkpoint (a replay is run again, not
        resumed), the export after the last step only."""
        st, is_sync = self.state, self.config.system.is_sync
        old, new = tuple(st.roles), tuple(roles)
        old_actors, new_actors = actors(old, is_sync), actors(new, is_sync)
        members = tuple(r for r in range(len(new)) if r not in st.dead)
        src = min(old_actors & new_actors or old_actors)
        boundary = Boundary(st.version, new, old, members, src,
                            tuple(sorted(new_actors - old_actors)), None, export=is_final,
                            is_final=is_final)
        if not is_final:
            self.boundaries.pending = PendingBoundary(st.version, set(members), set(), set(), old)
        st.roles = list(roles)
        return [boundary]

    def _open(self, now: float) -> list[Command]:
        """The due step opens with every micro-batch it had, and closes."""
        st, due = self.state, self.due
        assert due is not None
        st.to(Phase.TRAINING)
        start = replace(due.start, step=st.step, attempt=0)
        start, _ = self.steps.begin(start, now, st.trainer_free_at, self.tracker,
                                    start.max_aggregate)
        current = self.steps.current
        assert current is not None
        current.group_ids |= due.group_ids
        current.samples = due.num_samples
        current.tokens = sum(mb.num_tokens for mb in due.micro_batches)
        current.is_closed = True
        return [start, *(self.steps.send(mb) for mb in due.micro_batches), CloseStep(st.step)]
