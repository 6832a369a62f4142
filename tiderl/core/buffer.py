"""The global rollout buffer: ready groups -> micro-batches of numbered global batches.

    group ready ──> pending (ready order) ──assign whole groups to the open batch b──┐
                     │ staleness b − oldest > bound: discarded                        │
                     v                                                               v
          next_micro_batch(assigned, is_last = b is full) ──> micro-batch of b ──> trainer
                                                      └──> ReadinessTracker.record_ready

Batch b is consumed by training step b with policy version b, so a group's staleness is known
when it is assigned: b minus the version of its oldest tokens. A group above the bound is dropped
there and its tokens count as discarded. Batch sizes are whole groups: B_ideal unless the
step controller sets the open batch's size (ERS's elastic batch). Micro-batches are formed with
``tiderl.core.ra2p.next_micro_batch`` as data arrives, for ``num_dp_ranks`` (the step controller
sets it to the coming step's actor ranks); the last ones of a batch with ``is_last=True`` (the
smallest sequences at the end). Micro-batches that waited for their step while the layout changed
(formed during step b - 1 for its DP size) are cut again for the consuming step's (``recut``).
The step controller owns the one buffer; each substrate hands it its own group type
(:class:`ReadyGroup`).

Each call returns what happened (:class:`BufferEvents`: groups dropped, micro-batches formed,
batches closed); the step controller handles them after the call, so nothing calls back into it
while the buffer is mid-fill.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from tiderl.core.ra2p import form_micro_batches, next_micro_batch
from tiderl.core.readiness import ReadinessTracker
from tiderl.core.types import MicroBatch, SeqRef


class ReadyGroup(Protocol):
    """A finished GRPO group as the buffer sees it: its training sequences (one per task, or
    several where a trajectory is split, e.g. by screenshot pruning) and its GRPO samples (one
    per task: what batch sizes and the staleness window count)."""

    @property
    def group_id(self) -> str: ...

    @property
    def oldest_version(self) -> int: ...

    @property
    def sequences(self) -> tuple[SeqRef, ...]: ...

    @property
    def num_samples(self) -> int: ...


G = TypeVar("G", bound=ReadyGroup)


@dataclass(frozen=True, slots=True)
class BufferShape:
    """How the buffer cuts batches: whole groups of ``group_size`` samples, ``batch_ideal``
    samples a batch unless the step controller sets one smaller, at most ``max_staleness``
    versions behind (the job's bound and the versions it carries stragglers:
    ``StepControlConfig.drop_staleness``), micro-batches filled to ``tokens_per_rank`` per DP
    rank."""

    group_size: int
    batch_ideal: int
    max_staleness: int
    tokens_per_rank: int


@dataclass(slots=True)
class Discarded:
    """Groups dropped as too stale to train, with their samples and tokens."""

    groups: int = 0
    samples: int = 0
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class BufferEvents(Generic[G]):
    """What one call did, batch by batch in increasing order; within a batch its stale groups
    were dropped first, then its micro-batches formed, then it closed (at most once)."""

    dropped: tuple[tuple[int, G], ...] = ()  # (the batch then open, a group too stale for it)
    micro_batches: tuple[tuple[int, MicroBatch], ...] = ()
    closed: tuple[int, ...] = ()

    @property
    def batches(self) -> list[int]:
        return sorted({b for b, _ in self.dropped} | {b for b, _ in self.micro_batches}
                      | set(self.closed))


class ReadyBuffer(Generic[G]):
    """Forms micro-batches for batch ``open_batch``; each call that can form or close one
    returns what it did (:class:`BufferEvents`)."""

    def __init__(self, tracker: ReadinessTracker, shape: BufferShape) -> None:
        self.tracker = tracker
        self.shape = shape
        self.num_dp_ranks = 1
        self.pending: deque[G] = deque()
        self.open_batch = 0
        self.need = shape.batch_ideal  # samples still to assign to the open batch
        self.assigned_samples = 0
        self._assigned: list[SeqRef] = []  # assigned to the open batch, not in a micro-batch
        self._num_formed = 0
        self._cut_for: dict[int, int] = {}  # mb_id -> the DP size it was formed for
        self.group_of_seq: dict[str, G] = {}
        self.discarded = Discarded()
        self.max_staleness_seen: dict[int, int] = {}  # batch -> max staleness assigned to it
        self.buffered_tokens = 0  # ready, not yet consumed (pending + micro-batches)

    def add_group(self, group: G, now: float) -> BufferEvents[G]:
        self.pending.append(group)
        self.buffered_tokens += _tokens(group)
        return self._fill(now)

    def set_batch_size(self, batch: int, samples: int, now: float) -> BufferEvents[G]:
        """ERS's elastic batch for ``batch`` (rounded up to whole groups, at most B_ideal)."""
        if batch != self.open_batch:
            return BufferEvents()  # already closed at B_ideal
        size = min(self.shape.batch_ideal, -(-samples // self.shape.group_size)
                   * self.shape.group_size)
        self.need = max(0, size - self.assigned_samples)
        return self._fill(now)

    def _fill(self, now: float) -> BufferEvents[G]:
        """Assign pending groups to the open batch; form micro-batches; close full batches."""
        dropped: list[tuple[int, G]] = []
        mbs: list[tuple[int, MicroBatch]] = []
        closed: list[int] = []
        while True:
            dropped += [(self.open_batch, g) for g in self._drop_stale()]
            while self.pending and self.need > 0:
                self._assign(self.pending.popleft())
            is_full = self.need <= 0
            mbs += [(self.open_batch, mb) for mb in self._emit(now, is_last=is_full)]
            if not is_full:
                return BufferEvents(tuple(dropped), tuple(mbs), tuple(closed))
            closed.append(self.open_batch)
            self.open_batch += 1
            self.need = self.shape.batch_ideal
            self.assigned_samples = 0

    def _drop_stale(self) -> list[G]:
        out = []
        while self.pending:
            group = self.pending[0]
            if self.open_batch - group.oldest_version <= self.shape.max_staleness:
                break
            self.pending.popleft()
            tokens = _tokens(group)
            self.buffered_tokens -= tokens
            self.discarded.groups += 1
            self.discarded.samples += group.num_samples
            self.discarded.tokens += tokens
            out.append(group)
        return out

    def _assign(self, group: G) -> None:
        staleness = self.open_batch - group.oldest_version
        seen = self.max_staleness_seen.get(self.open_batch, 0)
        self.max_staleness_seen[self.open_batch] = max(seen, staleness)
        for seq in group.sequences:
            self.group_of_seq[seq.seq_id] = group
            self._assigned.append(seq)
        self.need -= group.num_samples
        self.assigned_samples += group.num_samples

    def _emit(self, now: float, is_last: bool) -> list[MicroBatch]:
        out = []
        while self._assigned:
            mb = next_micro_batch(self._assigned, self.num_dp_ranks, self.shape.tokens_per_rank,
                                  is_last=is_last, mb_id=self._num_formed, ready_time=now)
            if mb is None:
                break
            taken = {s.seq_id for s in mb.sequences}
            self._assigned = [s for s in self._assigned if s.seq_id not in taken]
            self._num_formed += 1
            self._cut_for[mb.mb_id] = self.num_dp_ranks
            self.tracker.record_ready((self.open_batch, mb.mb_id), now, len(mb.sequences),
                                      mb.num_tokens)
            out.append(mb)
        return out

    def recut(self, batch: int, mbs: list[MicroBatch], num_dp_ranks: int) -> list[MicroBatch]:
        """``batch``'s waiting micro-batches (in ready order) for a step on ``num_dp_ranks``
        actors: as they are if every one was formed for that size, else their sequences cut again
        (call before the step's ``ReadinessTracker.start_step``: the ready events are replaced).
        Each new micro-batch is ready when its last sequence was; while ``batch`` is still open,
        a remainder short of the token target goes back to wait for more sequences."""
        if all(self._cut_for.get(mb.mb_id) == num_dp_ranks for mb in mbs):
            return mbs
        ready_at = {s.seq_id: mb.ready_time for mb in mbs for s in mb.sequences}
        seqs = [s for mb in mbs for s in mb.sequences]
        for mb in mbs:
            self.tracker.record_consumed((batch, mb.mb_id))
            self._cut_for.pop(mb.mb_id, None)
        tokens_per_rank = self.shape.tokens_per_rank
        if batch < self.open_batch:
            new = form_micro_batches(seqs, num_dp_ranks, tokens_per_rank,
                                     first_mb_id=self._num_formed, ready_times=ready_at)
        else:
            new = []
            while (mb := next_micro_batch(seqs, num_dp_ranks, tokens_per_rank,
                                          is_last=False, mb_id=self._num_formed + len(new))):
                ready = max(ready_at[s.seq_id] for s in mb.sequences)
                new.append(replace(mb, ready_time=ready))
                seqs = seqs[len(mb.sequences):]
            self._assigned = seqs + self._assigned
        self._num_formed += len(new)
        for mb in new:
            self._cut_for[mb.mb_id] = num_dp_ranks
            self.tracker.record_ready((batch, mb.mb_id), mb.ready_time, len(mb.sequences),
                                      mb.num_tokens)
        return new

    def consume(self, batch: int, mb: MicroBatch) -> int:
        """The trainer took ``mb``: out of the buffer; returns its tokens."""
        self.tracker.record_consumed((batch, mb.mb_id))
        self._cut_for.pop(mb.mb_id, None)
        for seq in mb.sequences:
            del self.group_of_seq[seq.seq_id]
        self.buffered_tokens -= mb.num_tokens
        return mb.num_tokens


def _tokens(group: ReadyGroup) -> int:
    return sum(seq.num_tokens for seq in group.sequences)
