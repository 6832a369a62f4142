"""Block-granular KV cache of one simulated rollout rank: a counting model of vLLM prefix caching.

Layout of one task's context (``bs`` = block size)::

    | group prompt, full blocks (shared) | task's own tokens ........ | partial |
    |<-- group entry, refcounted ------->|<-- task entry ------------------->|

The group entry holds the ``prompt_tokens // bs`` full blocks of the GRPO group's prompt and is
shared by the group's tasks on this rank; the task entry holds everything after it (including the
prompt's partial last block, as in vLLM, where only full blocks are hashed and shared).

An entry is *referenced* while a request of it runs or (tasks) it is pinned; a group entry while
any of its tasks is. Unreferenced entries are *cached*: they keep only their full, valid blocks
and are evicted in LRU order of their last use, tail-first within an entry (vLLM frees a
request's blocks in reverse order), so a partly evicted context still hits on its prefix.

Hits are whole blocks of a valid prefix chain: the task's own blocks count only when the whole
group prompt is resident, and at most ``(context − 1) // bs`` blocks hit (vLLM always computes
the last token). The partially filled last block is therefore recomputed on the next turn.

Invariant: used blocks = Σ entry blocks ≤ capacity, and cached blocks are exactly the blocks of
the entries in the LRU queue.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class TurnAlloc(NamedTuple):
    """What a turn start costs: ``hit_tokens`` reused from cache, ``compute_tokens`` to prefill.
    (A named tuple: one is made per turn, and a frozen dataclass costs several times more to
    build.)"""

    hit_tokens: int
    compute_tokens: int


class _Entry:
    """One task's own blocks, or one group's shared prompt blocks, on this rank."""

    __slots__ = ("blocks", "group", "hit_blocks", "hit_group_blocks", "is_group", "key", "members",
                 "refs", "running", "stale", "tokens", "valid")

    def __init__(self, key: str, is_group: bool, group: _Entry | None = None) -> None:
        self.key = key
        self.is_group = is_group
        self.group = group  # task entries: their group's entry
        self.blocks = 0  # allocated blocks
        self.valid = 0  # leading full blocks whose content can be hit
        self.stale = False  # content predates a weight update (flush while referenced)
        self.tokens = 0  # tasks: own context tokens (after the shared prompt blocks)
        self.running = False  # tasks: a request is running
        self.refs = 0  # groups: tasks of the group that are running or pinned
        self.members = 0  # groups: tasks of the group on this rank
        self.hit_blocks = 0  # tasks: own blocks hit by the current turn (for abort_turn)
        self.hit_group_blocks = 0  # tasks: group blocks hit by the current turn


# A turn's plan, in blocks: (shared: the full prompt blocks, the group entry's size; own_tokens:
# context tokens in the task entry; own_blocks: the blocks the task entry needs; hit_group,
# hit_own: blocks hit in the group and the task entry; new_blocks: blocks to allocate, evicting
# if needed). A plain tuple: one is made per turn.
_TurnPlan = tuple[int, int, int, int, int, int]


class SimKVCache:
    """The KV cache of one rollout rank, counted in blocks of ``block_size`` tokens."""

    def __init__(self, capacity_tokens: int, block_size: int = 16) -> None:
        if block_size < 1 or capacity_tokens < 0:
            raise ValueError(f"bad cache shape: {capacity_tokens} tokens, block {block_size}")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._tasks: dict[str, _Entry] = {}
        self._groups: dict[str, _Entry] = {}
        self._pinned: set[str] = set()
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # cached entries, oldest first
        self._used = 0  # blocks allocated (referenced + cached)
        self._cached = 0  # blocks of entries in the LRU queue
        self.query_tokens = 0
        self.hit_tokens = 0
        self.num_preemptions = 0
        self.evicted_tokens = 0  # dropped by LRU eviction under memory pressure
        self.preempted_tokens = 0
        self.flushed_tokens = 0
        self.num_flushes = 0  # weight updates so far: KV from before the last one is stale

    # ---- sizes ----

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    @property
    def used_tokens(self) -> int:
        return self._used * self.block_size

    @property
    def referenced_tokens(self) -> int:
        return (self._used - self._cached) * self.block_size

    @property
    def cached_tokens(self) -> int:
        return self._cached * self.block_size

    @property
    def free_tokens(self) -> int:
        return (self.capacity_blocks - self._used) * self.block_size

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def has_task(self, task_id: str) -> bool:
        return task_id in self._tasks

    def is_running(self, task_id: str) -> bool:
        entry = self._tasks.get(task_id)
        return entry is not None and entry.running

    def task_blocks(self, task_id: str) -> int:
        """Blocks the task's own entry holds now (0 if unknown)."""
        entry = self._tasks.get(task_id)
        return entry.blocks if entry is not None else 0

    # ---- turns ----

    def peek_turn(self, task_id: str, group_id: str, prompt_tokens: int, context_tokens: int,
                  kept_prefix: int | None = None) -> TurnAlloc | None:
        """What ``begin_turn`` would return now, changing nothing and counting nothing."""
        plan = self._plan(task_id, group_id, prompt_tokens, context_tokens, kept_prefix)
        return None if plan is None else self._alloc_of(plan, context_tokens)

    def begin_turn(self, task_id: str, group_id: str, prompt_tokens: int, context_tokens: int,
                   now: float, kept_prefix: int | None = None) -> TurnAlloc | None:
        """Start a request with ``context_tokens`` of context; None (no change) if it cannot fit.

        ``kept_prefix`` (multimodal pruning) caps the task's valid KV at that many tokens first.
        """
        plan = self._plan(task_id, group_id, prompt_tokens, context_tokens, kept_prefix)
        if plan is None:
            return None
        self._commit(task_id, group_id, plan)
        alloc = self._alloc_of(plan, context_tokens)
        self.query_tokens += context_tokens
        self.hit_tokens += alloc.hit_tokens
        return alloc

    def grow(self, task_id: str, new_tokens: int, now: float) -> bool:
        """Decode appended ``new_tokens``; False (no change) when the blocks cannot be found."""
        entry = self._running_entry(task_id)
        tokens = entry.tokens + new_tokens
        needed = self._blocks_for(tokens) - entry.blocks
        if needed > 0:
            if needed > self.capacity_blocks - self._used + self._cached:  # free + cached
                return False
            self._allocate(needed)
            entry.blocks += needed
        entry.tokens = tokens
        return True

    def abort_turn(self, task_id: str, now: float) -> None:
        """Undo a ``begin_turn`` whose prefill never ran (e.g. its output could not be reserved).

        Only the blocks that were hits stay valid; the rest are freed as on ``end_turn``. Not a
        preemption: no counter moves.
        """
        entry = self._running_entry(task_id)
        entry.running = False
        entry.valid = 0 if entry.stale else entry.hit_blocks
        group = entry.group
        if group.refs == 1:  # nobody else computed the prompt either
            group.valid = min(group.valid, entry.hit_group_blocks)
        if task_id not in self._pinned:
            self._unreference(entry)

    def end_turn(self, task_id: str, now: float) -> None:
        """The request finished: its full blocks become cached (or stay, if pinned)."""
        entry = self._running_entry(task_id)
        entry.running = False
        entry.valid = 0 if entry.stale else entry.tokens // self.block_size
        if task_id not in self._pinned:
            self._unreference(entry)

    def pin(self, task_id: str) -> None:
        """Keep the task's blocks referenced across turns (the task need not be here yet)."""
        if task_id in self._pinned:
            return
        entry = self._tasks.get(task_id)
        if entry is not None and not entry.running:
            self._reference(entry)
        self._pinned.add(task_id)

    def unpin(self, task_id: str) -> None:
        if task_id not in self._pinned:
            return
        self._pinned.discard(task_id)
        entry = self._tasks.get(task_id)
        if entry is not None and not entry.running:
            self._unreference(entry)

    def preempt(self, task_id: str, now: float) -> int:
        """Recompute-preemption: drop the task's own blocks; returns the context tokens lost."""
        entry = self._tasks[task_id]
        dropped = min(entry.tokens, entry.blocks * self.block_size)
        self._drop_blocks(entry)
        entry.tokens = 0
        if entry.running:
            entry.running = False
            if task_id not in self._pinned:
                self._group_unreference(entry.group)
        self.num_preemptions += 1
        self.preempted_tokens += dropped
        return dropped

    def release(self, task_id: str) -> None:
        """The task finished or left this rank: its blocks are freed, not cached."""
        entry = self._tasks.pop(task_id, None)
        is_pinned = task_id in self._pinned
        self._pinned.discard(task_id)
        if entry is None:
            return
        self._drop_blocks(entry)
        group = entry.group
        group.members -= 1
        if entry.running or is_pinned:
            self._group_unreference(group)
        self._forget_group_if_empty(group)

    def flush(self) -> int:
        """After a weight update: drop every cached block, mark referenced content stale."""
        self.num_flushes += 1
        dropped = self._cached
        for entry in self._lru:
            entry.blocks = entry.valid = 0
        self._used -= self._cached
        self._cached = 0
        self._lru.clear()
        for entry in (*self._tasks.values(), *self._groups.values()):
            if entry.blocks:
                entry.stale, entry.valid = True, 0
        for group in list(self._groups.values()):
            self._forget_group_if_empty(group)
        self.flushed_tokens += dropped * self.block_size
        return dropped * self.block_size

    # ---- planning ----

    def _plan(self, task_id: str, group_id: str, prompt_tokens: int, context_tokens: int,
              kept_prefix: int | None) -> _TurnPlan | None:
        bs = self.block_size
        task = self._tasks.get(task_id)
        group = self._groups.get(group_id)
        if task is not None and (task.running or task.group.key != group_id):
            raise ValueError(f"task {task_id!r} is running or belongs to another group")
        shared = min(prompt_tokens, context_tokens) // bs
        own_tokens = context_tokens - shared * bs
        own_blocks = -(-own_tokens // bs)
        hit_group, hit_own = self._hits(task, group, shared, context_tokens, kept_prefix)
        # the blocks its entries lack, against what it can get: the free and cached blocks
        # (less its entries' own cached ones: it takes them back) and the blocks its entry holds
        # beyond what it needs (this turn's context can be shorter, after pruning)
        new_blocks = shared
        available = self.capacity_blocks - self._used + self._cached
        if group is not None:
            new_blocks = shared - group.blocks if shared > group.blocks else 0
            if group in self._lru:
                available -= group.blocks
        if task is None:
            new_blocks += own_blocks
        else:
            if own_blocks > task.blocks:
                new_blocks += own_blocks - task.blocks
            else:
                available += task.blocks - own_blocks
            if task in self._lru:
                available -= task.blocks
        if new_blocks > available:
            return None
        return shared, own_tokens, own_blocks, hit_group, hit_own, new_blocks

    def _hits(self, task: _Entry | None, group: _Entry | None, shared: int, context_tokens: int,
              kept_prefix: int | None) -> tuple[int, int]:
        """Blocks hit in the group and the task entry: a valid prefix chain of full blocks."""
        limit = max(0, context_tokens - 1) // self.block_size
        if kept_prefix is not None:
            limit = min(limit, kept_prefix // self.block_size)
        hit_group = min(group.valid if group is not None else 0, shared, limit)
        if hit_group < shared or task is None:
            return hit_group, 0
        return hit_group, min(task.valid, limit - shared)

    def _alloc_of(self, plan: _TurnPlan, context_tokens: int) -> TurnAlloc:
        hit = (plan[3] + plan[4]) * self.block_size  # hit_group + hit_own
        return TurnAlloc(hit_tokens=hit, compute_tokens=context_tokens - hit)

    def _commit(self, task_id: str, group_id: str, plan: _TurnPlan) -> None:
        shared, own_tokens, own_blocks, hit_group, hit_own, new_blocks = plan
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = _Entry(group_id, is_group=True)
        task = self._tasks.get(task_id)
        if task is None:
            task = self._tasks[task_id] = _Entry(task_id, is_group=False, group=group)
            group.members += 1
            if task_id in self._pinned:
                self._group_reference(group)
        if task_id not in self._pinned:
            self._reference(task)
        if task.blocks > own_blocks:
            self._used -= task.blocks - own_blocks
            task.blocks = own_blocks
        if new_blocks:
            self._allocate(new_blocks)
        group.blocks = max(group.blocks, shared)
        group.valid, group.stale = shared, False  # the prefill recomputes the rest
        task.blocks = own_blocks
        task.tokens, task.valid, task.stale = own_tokens, hit_own, False
        task.hit_blocks, task.hit_group_blocks = hit_own, hit_group
        task.running = True

    # ---- references ----

    def _reference(self, task: _Entry) -> None:
        """The task entry becomes referenced (it was neither running nor pinned)."""
        self._take_from_lru(task)
        self._group_reference(task.group)

    def _group_reference(self, group: _Entry) -> None:
        group.refs += 1
        if group.refs == 1:
            self._take_from_lru(group)

    def _unreference(self, task: _Entry) -> None:
        """The task entry is neither running nor pinned any more: cache its valid blocks."""
        self._cache(task)
        self._group_unreference(task.group)

    def _group_unreference(self, group: _Entry) -> None:
        group.refs -= 1
        if group.refs == 0:
            self._cache(group)
            self._forget_group_if_empty(group)

    def _cache(self, entry: _Entry) -> None:
        """Keep only the entry's valid full blocks and queue it as most recently used."""
        keep = 0 if entry.stale else min(entry.valid, entry.blocks)
        self._used -= entry.blocks - keep
        entry.blocks = entry.valid = keep
        entry.stale = False
        if keep:
            self._lru[entry] = None
            self._cached += keep

    def _take_from_lru(self, entry: _Entry) -> None:
        if entry in self._lru:
            del self._lru[entry]
            self._cached -= entry.blocks

    def _forget_group_if_empty(self, group: _Entry) -> None:
        if group.members == 0 and group.blocks == 0 and group.refs == 0:
            self._groups.pop(group.key, None)

    # ---- blocks ----

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _allocate(self, num_blocks: int) -> None:
        shortfall = num_blocks - (self.capacity_blocks - self._used)
        if shortfall > 0:
            self._evict(shortfall)
        self._used += num_blocks

    def _drop_blocks(self, entry: _Entry) -> None:
        """Free all of an entry's blocks (they are not cached)."""
        self._take_from_lru(entry)
        self._used -= entry.blocks
        entry.blocks = entry.valid = 0

    def _evict(self, num_blocks: int) -> None:
        """Evict ``num_blocks`` cached blocks: oldest entry first, tail blocks first within it."""
        while num_blocks > 0:
            entry = next(iter(self._lru))
            take = min(num_blocks, entry.blocks)
            entry.blocks -= take
            entry.valid = min(entry.valid, entry.blocks)
            self._used -= take
            self._cached -= take
            self.evicted_tokens += take * self.block_size
            num_blocks -= take
            if entry.blocks == 0:
                del self._lru[entry]
                if entry.is_group:
                    self._forget_group_if_empty(entry)

    def _running_entry(self, task_id: str) -> _Entry:
        entry = self._tasks.get(task_id)
        if entry is None or not entry.running:
            raise ValueError(f"task {task_id!r} has no running request on this rank")
        return entry
