"""The open step and the micro-batches of the steps not open yet.

    buffer: micro-batch of batch b ──take──> Dispatch (step b open and streaming) or waiting[b]
            batch b complete ──closed_batch──> CloseStep (step b open) or closed
    step b opens ──open / again──> StartStep, then its waiting micro-batches (and, for an
        attempt after a trainer rank died, first the ones its failed attempt had), CloseStep
        when its batch was complete already

A step that runs again (no live actor updated) sends the micro-batches its failed attempt had
before any new one, colocated on its actors (a Ref rank's messages of the failed attempt may
still wait in the actors' queues), as the next attempt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tiderl.core.buffer import ReadyBuffer
from tiderl.core.commands import CloseStep, Command, Dispatch, RankReport, StartStep
from tiderl.core.readiness import ReadinessTracker
from tiderl.core.records import StepRecord
from tiderl.core.step_control.config import StepControlConfig
from tiderl.core.step_control.inputs import MeasuredPasses, learn_passes, step_placement
from tiderl.core.step_control.state import CycleState, OpenStep, actors
from tiderl.core.system import StepMode
from tiderl.core.types import MicroBatch, Placement, ReadinessSignals, Role


@dataclass
class StepRunner:
    current: OpenStep | None = None
    retry: OpenStep | None = None  # an attempt a trainer rank died in, to open again
    waiting: dict[int, list[MicroBatch]] = field(default_factory=dict)  # by batch, in order
    closed: set[int] = field(default_factory=set)  # complete before their step opened
    passes: dict[Placement, MeasuredPasses] = field(default_factory=dict)  # the last of each layout

    def is_open(self, batch: int) -> bool:
        """Step ``batch`` is open and takes micro-batches (not an attempt a rank died in)."""
        current = self.current
        return current is not None and not current.is_aborted and batch == current.start.step

    def take(self, batch: int, mb: MicroBatch, is_streaming: bool,
             buffer: ReadyBuffer) -> list[Command]:
        """A micro-batch of ``batch`` is formed: to the open step, or waiting for its own."""
        if self.is_open(batch) and is_streaming:
            return [self.dispatch(mb, buffer)]
        self.waiting.setdefault(batch, []).append(mb)
        return []

    def learn(self, reports: Sequence[RankReport], start: StartStep) -> None:
        """A trained step's pass times: the last measure of its layout."""
        layout = Placement.DECOUPLED if start.step_mode is StepMode.DECOUPLED \
            else Placement.COLOCATED
        self.passes[layout] = learn_passes(reports, start)

    def closed_batch(self, batch: int) -> list[Command]:
        """Batch ``batch`` is complete: the open step's closes; another waits for its step."""
        if self.is_open(batch):
            assert self.current is not None
            self.current.is_closed = True
            return [CloseStep(batch)]
        self.closed.add(batch)
        return []

    def begin(self, start: StartStep, now: float, ready_at: float, tracker: ReadinessTracker,
              max_aggregate: int) -> tuple[StartStep, list[MicroBatch]]:
        """Open step ``start``: a new one (its RAS: what is buffered now) or, when a trainer
        rank died in it, its next attempt (with the micro-batches to send again first)."""
        if self.retry is not None:
            return self.open_again(start, max_aggregate)
        tracker.start_step(now)
        self.current = OpenStep(start, now, ready_at, tracker.step_ras)
        return start, []

    def open_again(self, start: StartStep,
                   max_aggregate: int) -> tuple[StartStep, list[MicroBatch]]:
        """The step a trainer rank died in, as its next attempt: its start, and the micro-batches
        it had (sent again before any new one)."""
        retry, self.retry = self.retry, None
        assert retry is not None
        if start.step_mode is StepMode.DECOUPLED:
            start = replace(start, step_mode=StepMode.COLOCATED, ref_ranks=(),
                            max_aggregate=max_aggregate)
        start = replace(start, attempt=retry.start.attempt + 1)
        self.current = replace(retry, start=start, num_micro_batches=0, sent=[],
                               is_closed=False, is_aborted=False)
        return start, retry.sent

    def run_again(self) -> OpenStep:
        """No live actor updated the open step: it opens again (``begin``); returns it."""
        current, self.current = self.current, None
        assert current is not None
        self.retry = current
        if current.is_closed:
            self.closed.add(current.start.step)
        return current

    def close_if_complete(self, step: int) -> list[Command]:
        """The step just opened closes at once when its batch was complete already."""
        if step not in self.closed:
            return []
        self.closed.discard(step)
        assert self.current is not None
        self.current.is_closed = True
        return [CloseStep(step)]

    def dispatch(self, mb: MicroBatch, buffer: ReadyBuffer) -> Dispatch:
        """``mb`` to the open step, out of the buffer; a group's samples count with its first
        sequence."""
        current = self.current
        assert current is not None
        for seq in mb.sequences:
            group = buffer.group_of_seq[seq.seq_id]
            if group.group_id not in current.group_ids:
                current.group_ids.add(group.group_id)
                current.samples += group.num_samples
        current.tokens += buffer.consume(current.start.step, mb)
        return self.send(mb)

    def send(self, mb: MicroBatch) -> Dispatch:
        current = self.current
        assert current is not None
        dispatch = Dispatch(current.start.step, current.num_micro_batches, mb)
        current.sent.append(mb)
        current.num_micro_batches += 1
        return dispatch


def step_start(state: CycleState, config: StepControlConfig, signals: ReadinessSignals,
               passes: dict[Placement, MeasuredPasses], records: Sequence[StepRecord], *,
               is_chosen_by_ra2p: bool) -> tuple[StartStep, Placement]:
    """Step ``state.step``'s mode and ranks, and RA2P's placement from then on. ERS plans it
    with the layout (its break-even is RA2P's cost model); without ERS, and outside a held
    manual plan (``is_chosen_by_ra2p``), RA2P chooses each step. A colocated step runs on the
    actor ranks only (a Ref rank then waits)."""
    step, roles, system, placement = state.step, state.roles, config.system, state.placement
    actor_ranks = tuple(r for r, role in enumerate(roles) if role is Role.ACTOR)
    refs = tuple(r for r, role in enumerate(roles) if role is Role.REF)
    fixed = system.fixed_step_mode
    if system.is_sync:
        start = StartStep(step, StepMode.BATCH, (), tuple(sorted(actors(roles, True))), 0)
    elif fixed is not None:
        start = StartStep(step, fixed, (), actor_ranks, 0 if fixed is StepMode.BATCH else 1)
    else:
        if not refs:
            placement = Placement.COLOCATED
        elif is_chosen_by_ra2p:
            placement = step_placement(config.ra2p, signals, passes, len(refs),
                                       len(actor_ranks), records)
        start = StartStep(step, StepMode.DECOUPLED, refs, actor_ranks, 1) \
            if placement is Placement.DECOUPLED \
            else StartStep(step, StepMode.COLOCATED, (), actor_ranks, config.ra2p.max_aggregate)
    return start, placement
