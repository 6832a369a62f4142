"""The CTB state book: rollout ranks, tasks and groups, kept up to date by events.

The step controller's :class:`~tiderl.core.step_control.RolloutControl` feeds a
:class:`TaskBook` the events of both substrates (turn reports, finishes, rank changes), asks a
policy for a plan (``policy.schedule(book)``) and applies it with ``book.apply(decisions)``.
The book keeps per-rank indexes so a scheduling round only looks at the tasks it may move::

    add_group ──> pending (FIFO, per group) ──Admit──> rank.active ──Pause──> paused
                                                  ^                               |
                                                  └────────────Resume─────────────┘
    report_turn: footprint and context of a task      finish_task / drop_task: it leaves the book
    wait_started / wait_ended: a task's environment wait (its length, per environment: WaitSamples)

Only tasks in flight live here: a finished or dropped task is forgotten, and so is a group once
none of its tasks is left. A NEW task's ``footprint`` is its admission estimate (its hint, else its
environment's mean probed first turn, ``default_footprint_tokens`` before any; then the group's
probed first-turn footprint); an ACTIVE or PAUSED task's is its last report. The estimates live in
a :class:`~tiderl.core.footprints.FootprintModel` the book feeds.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tiderl.core.env_waits import WaitSamples
from tiderl.core.footprints import FootprintModel
from tiderl.core.priority import PriorityWeights, priority
from tiderl.core.quote import short
from tiderl.core.staleness_window import StalenessWindow
from tiderl.core.types import (
    Admit,
    Decision,
    Group,
    GroupId,
    Pause,
    Resume,
    TaskId,
    TaskState,
)

# The states as module constants: on Python 3.11 reading a member through its class
# (TaskState.ACTIVE) goes through EnumType.__getattr__'s slow hook, about ten times a global's
# read, and the turn events below run millions of times in a simulation.
_NEW, _ACTIVE, _PAUSED = TaskState.NEW, TaskState.ACTIVE, TaskState.PAUSED


@dataclass(slots=True)
class TaskRecord:
    task_id: TaskId
    group_id: GroupId
    env: str
    is_eval: bool
    footprint: int  # KV tokens: last report once admitted, the admission estimate while NEW
    footprint_hint: int | None = None
    state: TaskState = TaskState.NEW
    rank: int | None = None  # current rank when ACTIVE, last rank when PAUSED, None when NEW
    context_len: int = 0
    is_running: bool = False  # a generation request is in flight (I_active)
    num_turns: int = 0
    # when its environment started on its last action (None: not waiting for it)
    waiting_since: float | None = None
    is_released: bool = False  # paused for its wait (Pause.released) until resumed
    # P(t), cached by TaskBook.priority (None: an input changed); a cache, not state
    priority: float | None = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class GroupRecord:
    """A GRPO group: its completion and first-turn probing state."""

    group_id: GroupId
    task_ids: tuple[TaskId, ...]  # all its tasks, the probe first
    has_eval: bool
    probe_task_id: TaskId | None = None
    probed_footprint: int | None = None
    num_finished: int = 0
    num_dropped: int = 0
    is_reserved: bool = False  # its first admission counted the whole group against the throttle
    # the KV its tasks on one rank share: its prompt's full blocks (0: not known, or not shared)
    prompt_tokens: int = 0
    pending: dict[TaskId, None] = field(default_factory=dict)  # NEW tasks, in FIFO order
    num_active_on: dict[int, int] = field(default_factory=dict)  # rank -> active tasks there

    @property
    def size(self) -> int:
        return len(self.task_ids)

    @property
    def completion(self) -> float:
        return self.num_finished / self.size

    @property
    def is_probed(self) -> bool:
        return self.probed_footprint is not None

    @property
    def num_open(self) -> int:
        return self.size - self.num_finished - self.num_dropped


@dataclass(slots=True)
class RankRecord:
    """A rollout rank: its budget B_r, its active tasks and their usage.

    ``footprints`` keeps their footprints sorted, for CTB's projected peak
    (``tiderl.core.ctb.projected_peak``).
    """

    rank: int
    budget: int  # B_r, in KV tokens
    # the KV its active tasks hold: the sum of their footprints, less each group's shared prompt
    # for every task of the group there but one (GroupRecord.prompt_tokens)
    usage: int = 0
    num_running: int = 0  # active tasks with a generation in flight
    active: dict[TaskId, TaskRecord] = field(default_factory=dict)
    footprints: list[int] = field(default_factory=list)  # of its active tasks, ascending
    num_env: dict[str, int] = field(default_factory=dict)  # env -> active tasks there

    @property
    def headroom(self) -> int:
        return self.budget - self.usage



def _bump(counts: dict, key: object, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, dropping the key when it reaches zero."""
    value = counts.get(key, 0) + delta
    if value:
        counts[key] = value
    else:
        del counts[key]


@dataclass(slots=True)
class TaskBook:
    """What CTB knows about the rollout side; events mutate it, policies only read it.

    Build it with ``CTBConfig.new_book()`` so that its priority weights, context norm and default
    footprint are the configured ones. Admissions of training tasks go through the staleness
    ``window``. It counts whole groups: a group's first admission (its probe) reserves all its
    NEW training tasks, so the siblings that follow the probe never wait behind other groups for
    a later version (a group straddling the window would train on data as old as its probe).
    """

    weights: PriorityWeights = field(default_factory=PriorityWeights)
    context_norm_tokens: int = 8192
    window: StalenessWindow = field(default_factory=StalenessWindow)
    ranks: dict[int, RankRecord] = field(default_factory=dict)  # sorted by rank id
    tasks: dict[TaskId, TaskRecord] = field(default_factory=dict)
    groups: dict[GroupId, GroupRecord] = field(default_factory=dict)
    pending_groups: dict[GroupId, GroupRecord] = field(default_factory=dict)  # FIFO
    paused: dict[TaskId, TaskRecord] = field(default_factory=dict)
    num_active: int = 0
    num_new: int = 0
    num_idle_ranks: int = 0  # rollout ranks with no generation in flight
    num_generating: int = 0  # active tasks with a generation in flight, on every rank
    footprints: FootprintModel = field(default_factory=FootprintModel)  # F and first turns
    # the engines' KV block: a group's tasks on one rank share its prompt's full blocks, as
    # prefix caching keeps them (0: no sharing counted)
    prompt_block_tokens: int = 0
    # the instant of the latest event (a wait's age is measured to it), each environment's
    # waits, and each rank's measured prefill rate (what recomputing a context costs there)
    now: float = 0.0
    waits: dict[str, WaitSamples] = field(default_factory=dict)
    prefill_tokens_per_s: dict[int, float] = field(default_factory=dict)

    # ------------------------------------------------------------------ queries

    @property
    def rank_ids(self) -> tuple[int, ...]:
        return tuple(self.ranks)

    @property
    def num_paused(self) -> int:
        return len(self.paused)

    @property
    def num_open_sessions(self) -> int:
        """Environment sessions held open: active plus paused tasks."""
        return self.num_active + len(self.paused)

    @property
    def train_admission_limit(self) -> int | None:
        """How many non-eval tasks may have been admitted in total; None when unthrottled."""
        return self.window.limit

    @property
    def num_admitted_train(self) -> int:
        return self.window.num_admitted

    @property
    def num_retired_train(self) -> int:
        return self.window.num_retired

    @property
    def tasks_per_step(self) -> int:
        return self.window.tasks_per_step

    def task(self, task_id: TaskId) -> TaskRecord:
        record = self.tasks.get(task_id)
        if record is None:
            raise KeyError(f"unknown task {short(task_id)}")
        return record

    def group_of(self, task: TaskRecord) -> GroupRecord:
        return self.groups[task.group_id]

    @property
    def num_finished(self) -> int:
        """Tasks finished so far."""
        return self.footprints.num_finished

    @property
    def is_footprint_measured(self) -> bool:
        """Whether F is measured (:meth:`FootprintModel.is_measured`)."""
        return self.footprints.is_measured()

    @property
    def expected_footprint(self) -> float:
        """F, what an admitted task's footprint grows to (:meth:`FootprintModel.expected`)."""
        return self.footprints.expected()

    def expected_wait(self, task: TaskRecord) -> float | None:
        """How much longer a task waiting for its environment can expect to wait, from its
        environment's recent waits; None when it is not waiting or none was measured."""
        samples = self.waits.get(task.env)
        if task.waiting_since is None or samples is None:
            return None
        return samples.remaining(self.now - task.waiting_since)

    def recompute_s(self, task: TaskRecord) -> float | None:
        """What prefilling the task's context again costs on its rank; None when the rank's
        prefill rate is not measured."""
        rate = self.prefill_tokens_per_s.get(task.rank) if task.rank is not None else None
        return task.context_len / rate if rate else None

    def priority(self, task: TaskRecord) -> float:
        """P(t), cached on the task until an input changes (its context, I_active, its group's
        completion): turn events only drop it, a round computes the ones it reads."""
        if task.priority is None:
            group = self.groups[task.group_id]
            task.priority = priority(task, group, self.weights, self.context_norm_tokens)
        return task.priority

    def by_priority(self, rank: int) -> Iterator[TaskRecord]:
        """The active tasks of ``rank``, lowest (priority, footprint, task_id) first: a heap
        built when asked and popped lazily (the pause phase takes only the few it needs)."""
        heap = [(self.priority(t), t.footprint, t.task_id, t)
                for t in self._rank(rank).active.values()]
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)[3]

    def throttle_cost(self, task: TaskRecord) -> int:
        """What admitting ``task`` adds to ``num_admitted_train``: its group's NEW training tasks
        for the group's first admission, then 0 (the group is reserved); 0 for eval tasks."""
        group = self.groups[task.group_id]
        if task.is_eval or group.is_reserved:
            return 0
        return sum(1 for task_id in group.pending if not self.tasks[task_id].is_eval)

    def admissible(self, group: GroupRecord) -> list[TaskRecord]:
        """First-turn probing: an unprobed group offers only its probe, and only while NEW.

        All of them share one footprint estimate (see :meth:`admission_estimate`)."""
        if group.is_probed:
            return [self.tasks[task_id] for task_id in group.pending]
        if group.probe_task_id in group.pending:
            return [self.tasks[group.probe_task_id]]
        return []

    def admission_estimate(self, group: GroupRecord) -> int | None:
        """The footprint its admissible tasks would be admitted at; None when it has none."""
        if group.probed_footprint is not None:
            return group.probed_footprint
        if group.probe_task_id in group.pending:
            return self.tasks[group.probe_task_id].footprint
        return None

    def new_tasks(self) -> Iterator[TaskRecord]:
        """NEW tasks in FIFO order."""
        for group in self.pending_groups.values():
            for task_id in group.pending:
                yield self.tasks[task_id]

    # ------------------------------------------------------------------ rank events

    def add_rank(self, rank: int, budget: int) -> None:
        if rank in self.ranks:
            raise ValueError(f"rank {rank} is already a rollout rank")
        _check_tokens(budget, "budget")
        self.ranks[rank] = RankRecord(rank, budget)
        self.ranks = dict(sorted(self.ranks.items()))
        self.num_idle_ranks += 1

    def set_budget(self, rank: int, budget: int) -> None:
        _check_tokens(budget, "budget")
        self._rank(rank).budget = budget

    def remove_rank(self, rank: int) -> list[TaskId]:
        """``rank`` left rollout (a plan moved it, or it died): its active tasks become PAUSED with
        no rank (no KV moves); tasks paused there keep it as their last rank.

        Returns the tasks paused; they resume elsewhere later, with a fresh prefill.
        """
        record = self._rank(rank)
        moved = list(record.active.values())
        for task in moved:
            self._deactivate(task)
            task.state, task.rank = _PAUSED, None
            self.paused[task.task_id] = task
        del self.ranks[rank]
        self.num_idle_ranks -= 1
        return [task.task_id for task in moved]

    # ------------------------------------------------------------------ task events

    def add_group(self, new_group: Group) -> None:
        """Queue a group's tasks, FIFO; its first task is the probe of first-turn probing."""
        group_id, specs = new_group.group_id, new_group.tasks
        if group_id in self.groups:
            raise ValueError(f"group {short(group_id)} already exists")
        task_ids = tuple(spec.task_id for spec in specs)
        if self.tasks.keys() & task_ids:
            raise ValueError(f"group {short(group_id)} needs tasks with new ids")
        group = GroupRecord(group_id, task_ids, new_group.is_eval, task_ids[0])
        footprints = self.footprints
        for spec in specs:
            footprints.task_added(spec.env, spec.max_turns)
            hint = spec.footprint_hint
            footprint = footprints.first_turn(spec.env) if hint is None else hint
            self.tasks[spec.task_id] = TaskRecord(
                spec.task_id, group_id, spec.env, spec.is_eval, footprint, hint
            )
            group.pending[spec.task_id] = None
        self.groups[group_id] = group
        self.pending_groups[group_id] = group
        self.num_new += len(specs)

    def report_turn(
        self, task_id: TaskId, footprint: int, context_len: int, is_running: bool = True,
        prompt_tokens: int | None = None,
    ) -> None:
        """An admitted task's footprint and context now (reported when a generation ends). The
        probe's first report sets its group's probed footprint, the estimate its NEW siblings are
        admitted at, and joins its environment's first-turn mean, the estimate of the NEW tasks
        of unprobed groups with no hint. ``prompt_tokens``: the prompt its group's tasks share,
        where known (the first report of the group's first task to report sets it)."""
        task = self.task(task_id)
        if prompt_tokens is not None:
            self._set_prompt(self.groups[task.group_id], prompt_tokens)
        if task.state is _NEW:
            raise ValueError(f"task {short(task_id)} reported a turn before it was admitted")
        _check_tokens(footprint, "footprint")
        if task.num_turns and not self.num_finished:  # F not measured yet
            self.footprints.turn_reported(task.env, task.footprint, footprint)
        if task.state is _ACTIVE:
            record = self.ranks[task.rank]
            record.usage += footprint - task.footprint
            _unsort(record.footprints, task.footprint)
            insort(record.footprints, footprint)
        task.footprint, task.context_len = footprint, context_len
        task.priority = None
        self._set_running(task, is_running)
        task.num_turns += 1
        group = self.groups[task.group_id]
        if not group.is_probed and task_id == group.probe_task_id:
            group.probed_footprint = footprint
            for sibling_id in group.pending:
                self.tasks[sibling_id].footprint = footprint
            self._probe_reported(task.env, footprint)

    def _set_prompt(self, group: GroupRecord, prompt_tokens: int) -> None:
        """The group's shared prompt, counted once per rank from now on: its full blocks, once
        (its tasks' usage drops where several of them are active on one rank)."""
        block = self.prompt_block_tokens
        if group.prompt_tokens or not block:
            return
        _check_tokens(prompt_tokens, "prompt_tokens")
        group.prompt_tokens = shared = prompt_tokens // block * block
        for rank, num_active in group.num_active_on.items():
            self.ranks[rank].usage -= shared * (num_active - 1)

    def _probe_reported(self, env: str, footprint: int) -> None:
        """A probe of ``env`` measured its first turn: the unprobed groups' NEW tasks of ``env``
        without a hint are admitted at the new mean (O(those tasks), once per group probed)."""
        self.footprints.probe_reported(env, footprint)
        estimate = self.footprints.first_turn(env)
        for group in self.pending_groups.values():
            if group.is_probed:
                continue
            for task_id in group.pending:
                task = self.tasks[task_id]
                if task.footprint_hint is None and task.env == env:
                    task.footprint = estimate

    def set_running(self, task_id: TaskId, is_running: bool) -> None:
        """A generation request of an active task started or returned (I_active)."""
        task = self.task(task_id)
        self._set_running(task, is_running)

    def wait_started(self, task_id: TaskId, now: float) -> None:
        """The task's environment is working on its action (from ``now``)."""
        self.task(task_id).waiting_since = now

    def wait_ended(self, task_id: TaskId, now: float) -> None:
        """The task's environment answered at ``now``: its wait joins its environment's."""
        task = self.task(task_id)
        if task.waiting_since is None:
            return
        samples = self.waits.get(task.env)
        if samples is None:
            samples = self.waits[task.env] = WaitSamples()
        samples.add(max(0.0, now - task.waiting_since))
        task.waiting_since = None

    def set_prefill_rate(self, rank: int, tokens_per_s: float) -> None:
        """``rank``'s engine prefills this many tokens a second (measured)."""
        if not tokens_per_s > 0:
            raise ValueError(f"a prefill rate must be > 0 tokens/s, got {tokens_per_s!r}")
        self.prefill_tokens_per_s[rank] = tokens_per_s

    def finish_task(self, task_id: TaskId) -> None:
        task = self.task(task_id)
        if task.state is _NEW:
            raise ValueError(f"task {short(task_id)} finished before it was admitted")
        group = self.groups[task.group_id]
        group.num_finished += 1
        self.footprints.task_finished(task.footprint)
        self._forget(task)
        for sibling_id in group.task_ids:  # their G_completion, hence priority, went up
            sibling = self.tasks.get(sibling_id)
            if sibling is not None:
                sibling.priority = None

    def drop_task(self, task_id: TaskId) -> None:
        """Abandon a task in any state (e.g. too stale); it does not count as finished."""
        task = self.task(task_id)
        self.groups[task.group_id].num_dropped += 1
        self._forget(task)

    def retire(self, num_tasks: int) -> None:
        """``num_tasks`` training tasks were trained or discarded: the staleness window moves."""
        if num_tasks < 0:
            raise ValueError(f"cannot retire {num_tasks} tasks")
        self.window.num_retired += num_tasks

    def set_tasks_per_step(self, num_tasks: int) -> None:
        """The global batch of the coming steps (ERS's elastic batch size), in tasks."""
        if num_tasks < 0:
            raise ValueError(f"tasks_per_step must be >= 0, got {num_tasks}")
        self.window.tasks_per_step = num_tasks

    # ------------------------------------------------------------------ the adapter

    def apply(self, decisions: Iterable[Decision]) -> None:
        """Apply a policy's plan, in order."""
        for decision in decisions:
            if isinstance(decision, Pause):
                self._pause(self.task(decision.task_id), decision.released)
            elif isinstance(decision, Resume):
                self._resume(self.task(decision.task_id), decision.rank)
            elif isinstance(decision, Admit):
                self._admit(self.task(decision.task_id), decision.rank)
            else:
                raise TypeError(f"not a CTB decision: {decision!r}")

    def _pause(self, task: TaskRecord, released: bool = False) -> None:
        _check_state(task, _ACTIVE, "pause")
        self._deactivate(task)
        task.state = _PAUSED  # rank kept: it is the task's last rank
        task.is_released = released
        self.paused[task.task_id] = task

    def _resume(self, task: TaskRecord, rank: int) -> None:
        _check_state(task, _PAUSED, "resume")
        del self.paused[task.task_id]
        task.is_released = False
        self._activate(task, rank)

    def _admit(self, task: TaskRecord, rank: int) -> None:
        _check_state(task, _NEW, "admit")
        self.window.num_admitted += self.throttle_cost(task)
        if not task.is_eval:
            self.groups[task.group_id].is_reserved = True
        self._unqueue(task)
        self._activate(task, rank)

    # ------------------------------------------------------------------ internals

    def _rank(self, rank: int) -> RankRecord:
        record = self.ranks.get(rank)
        if record is None:
            raise KeyError(f"rank {rank} is not a rollout rank")
        return record

    def _activate(self, task: TaskRecord, rank: int) -> None:
        record = self._rank(rank)
        record.active[task.task_id] = task
        group = self.groups[task.group_id]
        record.usage += task.footprint - (group.prompt_tokens if rank in group.num_active_on
                                          else 0)
        insort(record.footprints, task.footprint)
        _bump(record.num_env, task.env, 1)
        _bump(group.num_active_on, rank, 1)
        task.state, task.rank = _ACTIVE, rank
        self.num_active += 1

    def _deactivate(self, task: TaskRecord) -> None:
        """Take an ACTIVE task off its rank; it executes nothing until resumed."""
        record = self.ranks[task.rank]
        del record.active[task.task_id]
        group = self.groups[task.group_id]
        _bump(group.num_active_on, task.rank, -1)
        record.usage -= task.footprint - (group.prompt_tokens if task.rank in group.num_active_on
                                          else 0)
        _unsort(record.footprints, task.footprint)
        _bump(record.num_env, task.env, -1)
        self._set_running(task, False)
        self.num_active -= 1

    def _set_running(self, task: TaskRecord, is_running: bool) -> None:
        """I_active, and its rank's count of tasks generating: only an active task runs."""
        is_running = is_running and task.state is _ACTIVE
        if is_running == task.is_running:
            return
        task.is_running = is_running
        task.priority = None
        record = self.ranks[task.rank]
        record.num_running += 1 if is_running else -1
        self.num_generating += 1 if is_running else -1
        if record.num_running == (1 if is_running else 0):  # it just left or entered idleness
            self.num_idle_ranks += -1 if is_running else 1

    def _unqueue(self, task: TaskRecord) -> None:
        group = self.groups[task.group_id]
        del group.pending[task.task_id]
        if not group.pending:
            del self.pending_groups[group.group_id]
        self.num_new -= 1

    def _forget(self, task: TaskRecord) -> None:
        """Remove a finished or dropped task; a probe that never reported hands over."""
        if task.state is _ACTIVE:
            self._deactivate(task)
        elif task.state is _PAUSED:
            del self.paused[task.task_id]
        else:
            self._unqueue(task)
        del self.tasks[task.task_id]
        group = self.groups[task.group_id]
        if not group.is_probed and task.task_id == group.probe_task_id:
            group.probe_task_id = next(iter(group.pending), None)
        if group.num_open == 0:
            del self.groups[group.group_id]


def _unsort(values: list[int], value: int) -> None:
    """Remove one ``value`` from the sorted list ``values``."""
    del values[bisect_left(values, value)]


def _check_tokens(value: int, name: str) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0 tokens, got {value!r}")


def _check_state(task: TaskRecord, expected: TaskState, action: str) -> None:
    if task.state is not expected:
        raise ValueError(f"cannot {action} task {short(task.task_id)}: it is {task.state.value}")
