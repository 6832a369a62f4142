"""The rollout side: tasks, environments and engines, scheduled by the core's RolloutControl.

    add_group ──> SimTasks (their group is in the controller's book already)
    round: rollout.schedule(now) (CTB or request level; the book applies it) ──┐
                                                                               v
      Admit(t, r) ──> env reset ──> turn: turn_started, SimRequest ──> RolloutEngine r ──> done
                          ^                                                              │
                          └── env step (env_latency_s) <── turn_done(context) ───────────┤
      Pause(t): unpin; the task stops at its next turn boundary (held until Resume; its │
                env's answer is reported, so CTB with release_waiting can resume it)     │
      Resume(t, r): continue on r (another rank: its KV is released there, fresh prefill) │
                                                      last turn + env: task_finished ────┘
                                                      group complete ──> on_group_ready

Rounds run every ``ctb_round_interval_s`` while the book changed since the last one. A task
waiting for its environment holds no request: its blocks are cached (evictable) unless CTB pins
it. Every book event goes through :class:`tiderl.core.step_control.RolloutControl`, the same
object the runtime coordinator feeds; this module only simulates what it decides.
Invariant: a task has at most one request in flight, on the rank its KV lives on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tiderl.core.segments import segment_id
from tiderl.core.step_control import RolloutControl, reusable_tokens
from tiderl.core.types import Admit, Group, Pause, Resume, SeqRef, Task
from tiderl.sim.engine import RolloutEngine, SimRequest
from tiderl.sim.events import EventLoop
from tiderl.sim.hardware import CostModel
from tiderl.sim.kvcache import SimKVCache
from tiderl.sim.results import WindowSlots
from tiderl.sim.workload import TaskPlan


@dataclass(slots=True, eq=False)
class SimTask:
    plan: TaskPlan
    turn: int = 0  # index of the next (or current) turn
    context: int = 0  # context tokens after the last finished turn
    rank: int | None = None  # where its KV lives and its requests run
    is_paused: bool = False  # CTB paused it: it starts no new turn
    is_waiting_env: bool = False  # its environment is working (reset or step)
    request: SimRequest | None = None
    version: int | None = None  # policy version of its first turn (its oldest tokens)
    rank_next: int | None = None  # resumed elsewhere while a turn ran: move after the turn
    admitted_s: float | None = None  # when CTB first admitted it
    held_since: float | None = None  # its environment answered while it was paused
    held_s: float = 0.0  # summed: environment answered -> its turn started
    kept: tuple[int, int] | None = None  # (rank, its KV's flushes) its last turn's KV was made at
    task_id: str = field(init=False)  # the plan's (a field: it is read several times a turn)

    def __post_init__(self) -> None:
        self.task_id = self.plan.task_id


@dataclass(slots=True, eq=False)
class SimGroup:
    group_id: str
    tasks: list[SimTask]
    is_eval: bool
    num_open: int = 0
    ready_time: float = 0.0
    plans: list[TaskPlan] = field(default_factory=list)
    first_admit_s: float | None = None  # its first task's admission: its window places' start
    window: WindowSlots = field(default_factory=WindowSlots)  # its finished tasks' places so far
    finish_sum_s: float = 0.0  # Σ over its finished tasks of when each finished
    # the sequences, built on first use: the buffer reads them several times per group
    _sequences: tuple[SeqRef, ...] | None = field(default=None, init=False, repr=False)

    @property
    def oldest_version(self) -> int:
        return min(t.version for t in self.tasks if t.version is not None)

    @property
    def rewards(self) -> dict[str, float]:
        return {p.task_id: p.reward for p in self.plans}

    @property
    def sequences(self) -> tuple[SeqRef, ...]:
        """The group's training sequences, as the global buffer takes them: one per segment of
        each task (screenshot pruning splits a trajectory, paper App. C; a text task has one,
        named as its task, as on the runtime), ids ``<task_id>#<k>`` (:func:`segment_id`)."""
        if self._sequences is None:
            self._sequences = tuple(
                SeqRef(segment_id(p.task_id, k, len(segments)), n)
                for p in self.plans for segments in (p.segment_tokens,)
                for k, n in enumerate(segments))
        return self._sequences

    @property
    def num_samples(self) -> int:
        """GRPO samples: one per task, however many sequences its trajectory split into."""
        return len(self.plans)


def group_of(plans: list[TaskPlan] | tuple[TaskPlan, ...]) -> Group:
    """The tasks of a group of plans, as CTB's book holds them (no footprint hint: a task's
    first footprint is probed, as on a real rollout rank)."""
    return Group(plans[0].group_id, tuple(
        Task(p.task_id, p.group_id, p.env, p.is_eval, max_turns=p.max_turns) for p in plans))


def trajectory_tokens(plan: TaskPlan) -> int:
    """Tokens the trainer processes for a task: its training sequences (one per pruning, then
    the final one; a text task has exactly one)."""
    return sum(plan.segment_tokens)


class RolloutPool:
    """Rollout ranks driven by a scheduling policy; groups come out complete."""

    def __init__(self, loop: EventLoop, cost: CostModel, rollout: RolloutControl, *,
                 round_interval_s: float, block_size: int, max_running: int | None,
                 on_group_ready: Callable[[SimGroup], None]) -> None:
        self.loop = loop
        self.cost = cost
        self.rollout = rollout
        self.book = rollout.book  # read only: every change goes through ``rollout``
        self.pins_tasks = rollout.policy.pins_tasks
        self.releases = rollout.policy.releases_waiting
        self.round_interval_s = round_interval_s
        self.block_size = block_size
        self.max_running = max_running
        self.on_group_ready = on_group_ready
        self.kv_capacity = cost.kv_capacity_tokens()
        self.engines: dict[int, RolloutEngine] = {}
        self.closed: list[RolloutEngine] = []
        self.tasks: dict[str, SimTask] = {}
        self.groups: dict[str, SimGroup] = {}
        self.version = 0
        self.generated_tokens = 0  # trajectory tokens of finished training tasks
        self.eval_tokens = 0
        self.num_rounds = 0
        self.gpu_s_by_group: dict[str, float] = {}  # rollout time spent on each group's turns
        self.recompute_s = 0.0  # prefill of context computed before (kept apart from the groups)
        self.eval_groups: set[str] = set()
        self._is_dirty = False
        self._round_pending = False

    # ---- ranks ----

    def add_rank(self, rank: int) -> None:
        """An engine on ``rank`` (CTB placed the rank in its book)."""
        kv = SimKVCache(self.kv_capacity, self.block_size)
        self.engines[rank] = RolloutEngine(rank, self.loop, self.cost, kv, self._on_turn_done,
                                           self.max_running)
        self.mark_dirty()

    def remove_rank(self, rank: int) -> None:
        """``rank`` left rollout: its tasks are paused rank-less (CTB's book says so already);
        a turn in flight is abandoned (it restarts, with a fresh prefill, where the task
        resumes)."""
        engine = self.engines.pop(rank)
        abandoned = []
        for request in engine.close():
            self._spent(request)  # an abandoned turn's work is its group's all the same
            task = request.payload
            task.request = None
            task.context = _context_before(task)  # the turn restarts from its start
            abandoned.append(task)
        for task in self.tasks.values():
            if task.rank_next == rank:
                task.rank_next = None
                task.is_paused = not self._is_active_in_book(task)
            if task.rank == rank:
                task.rank, task.kept = None, None  # a rank added back has a new cache
                task.is_paused = not self._is_active_in_book(task)
        for task in abandoned:  # it waits to be placed again, as one held after its environment
            if task.is_paused and task.held_since is None:
                task.held_since = self.loop.now
        self.closed.append(engine)
        self.mark_dirty()

    def _is_active_in_book(self, task: SimTask) -> bool:
        record = self.book.tasks.get(task.task_id)
        return record is not None and record.state.value == "active"

    # ---- tasks ----

    def add_group(self, plans: list[TaskPlan] | tuple[TaskPlan, ...]) -> SimGroup:
        """Run a group whose tasks CTB's book holds (see :func:`group_of`)."""
        tasks = [SimTask(plan) for plan in plans]
        group = SimGroup(plans[0].group_id, tasks, plans[0].is_eval, len(tasks),
                         plans=list(plans))
        self.groups[group.group_id] = group
        if group.is_eval:
            self.eval_groups.add(group.group_id)
        for task in tasks:
            self.tasks[task.task_id] = task
        self.mark_dirty()
        return group

    def set_version(self, version: int) -> None:
        self.version = version
        self.mark_dirty()

    # ---- CTB rounds ----

    def mark_dirty(self) -> None:
        self._is_dirty = True
        if not self._round_pending:
            self._round_pending = True
            self.loop.after(0.0 if self.num_rounds == 0 else self.round_interval_s, self._tick)

    def _tick(self, _: object) -> None:
        self._round_pending = False
        if self._is_dirty:
            self.run_round()

    def run_round(self) -> None:
        """One scheduling round: the core decides and updates its book, this pool applies it."""
        self._is_dirty = False
        self.num_rounds += 1
        if self.releases:  # what recomputing a released task's context costs on each rank
            for rank, engine in self.engines.items():
                if engine.prefill_s > 0:
                    self.rollout.set_prefill_rate(rank, engine.prefill_tokens / engine.prefill_s)
        for decision in self.rollout.schedule(self.loop.now):
            task = self.tasks[decision.task_id]
            if isinstance(decision, Pause):
                self._pause(task)
            elif isinstance(decision, Resume):
                self._resume(task, decision.rank)
            elif isinstance(decision, Admit):
                self._admit(task, decision.rank)

    def _admit(self, task: SimTask, rank: int) -> None:
        now = self.loop.now
        task.admitted_s = now
        group = self.groups[task.plan.group_id]
        if group.first_admit_s is None:
            group.first_admit_s = now
        task.rank = rank
        task.is_waiting_env = True
        self.loop.after(task.plan.reset_latency_s, self._on_env_done, task)

    def _pause(self, task: SimTask) -> None:
        task.is_paused = True
        if task.rank is not None and task.rank in self.engines:
            self.engines[task.rank].kv.unpin(task.task_id)

    def _resume(self, task: SimTask, rank: int) -> None:
        task.is_paused = False
        if task.request is None:
            self._move(task, rank)
            if not task.is_waiting_env:
                self._start_turn(task)
        elif task.rank != rank:
            task.rank_next = rank  # it moves when this turn ends
        elif self.pins_tasks:
            self.engines[rank].kv.pin(task.task_id)

    def _move(self, task: SimTask, rank: int) -> None:
        """Put the task's KV home on ``rank``; leaving a rank frees its blocks there."""
        if task.rank != rank:
            if task.rank in self.engines:
                self.engines[task.rank].kv.release(task.task_id)
            task.kept = None  # its context is not in the new rank's cache
        task.rank = rank

    # ---- turns ----

    def _on_env_done(self, task: SimTask) -> None:
        task.is_waiting_env = False
        if task.turn == len(task.plan.turns):
            self._finish(task)
        elif not task.is_paused and task.rank is not None:
            self._start_turn(task)
        else:  # held until a Resume starts its turn; CTB learns it is ready
            task.held_since = self.loop.now
            self.rollout.turn_started(task.task_id, self.loop.now)
            if self.releases:
                self.mark_dirty()

    def _start_turn(self, task: SimTask) -> None:
        plan, k = task.plan, task.turn
        turn = plan.turns[k]
        if task.version is None:
            task.version = self.version
        if task.held_since is not None:
            task.held_s += self.loop.now - task.held_since
            task.held_since = None
        base = plan.prompt_tokens if k == 0 else task.context
        context = base + turn.context_add - turn.pruned_tokens
        task.context = context
        self.rollout.turn_started(task.task_id, self.loop.now)
        engine = self.engines[task.rank]
        kept = 0  # as the runtime counts: not after a weight update, a move or a pruning
        if k > 0 and turn.kept_prefix is None and task.kept == (task.rank,
                                                                  engine.kv.num_flushes):
            kept = base
        request = SimRequest(task.task_id, plan.group_id, plan.prompt_tokens, context,
                          turn.action_tokens, context if k == 0 else turn.context_add,
                          turn.kept_prefix, pin=self.pins_tasks and not task.is_paused,
                          reusable=reusable_tokens(kept, engine.kv.block_size),
                          flushes=engine.kv.num_flushes,
                          payload=task)
        task.request = request
        engine.submit(request)
        self.mark_dirty()

    def _spent(self, request: SimRequest) -> None:
        group = request.group_id
        spent = request.gpu_s - request.recompute_s
        self.gpu_s_by_group[group] = self.gpu_s_by_group.get(group, 0.0) + spent
        self.recompute_s += request.recompute_s

    def _on_turn_done(self, request: SimRequest) -> None:
        self._spent(request)
        task: SimTask = request.payload
        task.request = None
        turn = task.plan.turns[task.turn]
        task.context += turn.action_tokens
        task.turn += 1
        # its context as of the cache this turn began in: a flush since leaves it stale
        task.kept = (task.rank, request.flushes) if task.rank in self.engines else None
        if task.rank_next is not None:
            self._move(task, task.rank_next)
            task.rank_next = None
        self.rollout.turn_done(task.task_id, task.context, turn.action_tokens, self.loop.now,
                               reused=request.reused or 0, reusable=request.reusable,
                               prompt_tokens=task.plan.prompt_tokens)
        task.is_waiting_env = True
        self.loop.after(turn.env_latency_s, self._on_env_done, task)

    def _finish(self, task: SimTask) -> None:
        if task.rank in self.engines:
            self.engines[task.rank].kv.release(task.task_id)
        self.rollout.task_finished(task.task_id, self.loop.now)
        del self.tasks[task.task_id]
        group = self.groups[task.plan.group_id]
        self._account(task, group)
        tokens = trajectory_tokens(task.plan)
        if group.is_eval:
            self.eval_tokens += tokens
        else:
            self.generated_tokens += tokens
        group.num_open -= 1
        if group.num_open == 0:
            del self.groups[group.group_id]
            group.ready_time = now = self.loop.now
            group.window.sibling_s = len(group.tasks) * now - group.finish_sum_s
            self.on_group_ready(group)
        self.mark_dirty()

    def _account(self, task: SimTask, group: SimGroup) -> None:
        """A finished task's window place so far (the cluster adds its training wait)."""
        now, plan, slots = self.loop.now, task.plan, group.window
        admitted = now if task.admitted_s is None else task.admitted_s
        first = admitted if group.first_admit_s is None else group.first_admit_s
        env = plan.reset_latency_s + sum(turn.env_latency_s for turn in plan.turns)
        slots.tasks += 1
        slots.spread_s += admitted - first
        slots.env_s += env
        slots.held_s += task.held_s
        slots.engine_s += now - admitted - env - task.held_s
        group.finish_sum_s += now

    # ---- metrics ----

    def finished_in_open_groups(self) -> int:
        """Trajectory tokens of finished training tasks whose group is still open."""
        return sum(trajectory_tokens(t.plan) for g in self.groups.values() if not g.is_eval
                   for t in g.tasks if t.task_id not in self.tasks)

    def all_engines(self) -> list[RolloutEngine]:
        return [*self.closed, *self.engines.values()]

    def kv_counters(self) -> tuple[int, int]:
        """(query tokens, hit tokens) over every rank this pool ever had."""
        engines = self.all_engines()
        return sum(e.kv.query_tokens for e in engines), sum(e.kv.hit_tokens for e in engines)


def _context_before(task: SimTask) -> int:
    """Context before the current turn started (an abandoned turn restarts from it)."""
    plan, k = task.plan, task.turn
    if k == 0:
        return 0
    turn = plan.turns[k]
    return task.context - turn.context_add + turn.pruned_tokens
