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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
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


class ReadyBuffer(Generic[G]):
    """Forms micro-batches for batch ``open_batch``; ``on_micro_batch(b, mb)`` and
    ``on_batch_closed(b)`` tell the trainer; ``on_group_dropped(g)`` names a group discarded as too
    stale."""

    def __init__(self, tracker: ReadinessTracker, *, group_size: int, batch_ideal: int,
                 max_staleness: int, tokens_per_rank: int,
                 on_micro_batch: Callable[[int, MicroBatch], None],
                 on_batch_closed: Callable[[int], None],
                 on_group_dropped: Callable[[G], None] | None = None) -> None:
        self.tracker = tracker
        self.group_size = group_size
        self.batch_ideal = batch_ideal
        self.max_staleness = max_staleness
        self.tokens_per_rank = tokens_per_rank
        self.num_dp_ranks = 1
        self._on_micro_batch = on_micro_batch
        self._on_batch_closed = on_batch_closed
        self._on_group_dropped = on_group_dropped
        self.pending: deque[G] = deque()
        self.open_batch = 0
        self.need = batch_ideal  # samples still to assign to the open batch
        self.assigned_samples = 0
        self._assigned: list[SeqRef] = []  # assigned to the open batch, not in a micro-batch
        self._num_mbs = 0
        self._cut_for: dict[int, int] = {}  # mb_id -> the DP size it was formed for
        self.group_of_seq: dict[str, G] = {}
        self.tokens_of_seq: dict[str, int] = {}
        self.discarded_tokens = 0
        self.discarded_groups = 0
        self.discarded_samples = 0
        self.max_staleness_seen: dict[int, int] = {}  # batch -> max staleness assigned to it
        self.buffered_tokens = 0  # ready, not yet consumed (pending + micro-batches)

    def add_group(self, group: G, now: float) -> None:
        self.pending.append(group)
        self.buffered_tokens += _tokens(group)
        self._fill(now)

    def set_batch_size(self, batch: int, samples: int, now: float) -> None:
        """ERS's elastic batch for ``batch`` (rounded up to whole groups, at most B_ideal)."""
        if batch != self.open_batch:
            return  # already closed at B_ideal
        groups = -(-samples // self.group_size)
        size = min(self.batch_ideal, groups * self.group_size)
        self.need = max(0, size - self.assigned_samples)
        self._fill(now)

    def _fill(self, now: float) -> None:
        """Assign pending groups to the open batch; emit micro-batches; close full batches."""
        while True:
            self._drop_stale()
            while self.pending and self.need > 0:
                group = self.pending.popleft()
                self._assign(group)
            is_full = self.need <= 0
            self._emit(now, is_last=is_full)
            if not is_full:
                return
            self._close(now)

    def _drop_stale(self) -> None:
        while self.pending:
            group = self.pending[0]
            if self.open_batch - group.oldest_version <= self.max_staleness:
                return
            self.pending.popleft()
            tokens = _tokens(group)
            self.discarded_tokens += tokens
            self.buffered_tokens -= tokens
            self.discarded_groups += 1
            self.discarded_samples += group.num_samples
            if self._on_group_dropped is not None:
                self._on_group_dropped(group)

    def _assign(self, group: G) -> None:
        staleness = self.open_batch - group.oldest_version
        seen = self.max_staleness_seen.get(self.open_batch, 0)
        self.max_staleness_seen[self.open_batch] = max(seen, staleness)
        for seq in group.sequences:
            self.group_of_seq[seq.seq_id] = group
            self.tokens_of_seq[seq.seq_id] = seq.num_tokens
            self._assigned.append(seq)
        self.need -= group.num_samples
        self.assigned_samples += group.num_samples

    def _emit(self, now: float, is_last: bool) -> None:
        while self._assigned:
            mb = next_micro_batch(self._assigned, self.num_dp_ranks, self.tokens_per_rank,
                                  is_last=is_last, mb_id=self._num_mbs, ready_time=now)
            if mb is None:
                return
            taken = {s.seq_id for s in mb.sequences}
            self._assigned = [s for s in self._assigned if s.seq_id not in taken]
            self._num_mbs += 1
            self._cut_for[mb.mb_id] = self.num_dp_ranks
            self.tracker.record_ready((self.open_batch, mb.mb_id), now, len(mb.sequences),
                                      mb.num_tokens)
            self._on_micro_batch(self.open_batch, mb)

    def _close(self, now: float) -> None:
        batch = self.open_batch
        self.open_batch += 1
        self.need = self.batch_ideal
        self.assigned_samples = 0
        self._on_batch_closed(batch)

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
        if batch < self.open_batch:
            new = form_micro_batches(seqs, num_dp_ranks, self.tokens_per_rank,
                                     first_mb_id=self._num_mbs, ready_times=ready_at)
        else:
            new = []
            while (mb := next_micro_batch(seqs, num_dp_ranks, self.tokens_per_rank,
                                          is_last=False, mb_id=self._num_mbs + len(new))):
                ready = max(ready_at[s.seq_id] for s in mb.sequences)
                new.append(replace(mb, ready_time=ready))
                seqs = seqs[len(mb.sequences):]
            self._assigned = seqs + self._assigned
        self._num_mbs += len(new)
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
            del self.tokens_of_seq[seq.seq_id]
        self.buffered_tokens -= mb.num_tokens
        return mb.num_tokens


def _tokens(group: ReadyGroup) -> int:
    return sum(seq.num_tokens for seq in group.sequences)
