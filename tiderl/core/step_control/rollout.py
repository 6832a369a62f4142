"""CTB's half of the step cycle: the task book, its policy, the footprint rule and RWT.

    adapter ──turn_started / turn_done / task_finished──> TaskBook (footprints, I_active)
            ──schedule(now)──> policy.schedule(book) ──> book.apply ──> Admit / Pause / Resume

Every event first brings RWT up to ``now``, so both substrates integrate it at the same instants:
the book's counts (idle ranks, tasks waiting for admission) only change through these events.
"""

from __future__ import annotations

from tiderl.core.ctb import CTBConfig, SchedulingPolicy, TaskBook, make_policy
from tiderl.core.quote import short
from tiderl.core.types import Admit, Decision, Group, Resume, TaskState

_NEW = TaskState.NEW  # a module constant: a read through the class is slow on Python 3.11


def reusable_tokens(context_tokens: int, block_size: int) -> int:
    """What a turn's context leaves its engine to reuse on the task's next turn: its full KV
    blocks up to its last token (sampled, never fed back: its KV is never computed)."""
    return max(0, context_tokens - 1) // block_size * block_size


class RolloutWait:
    """RWT in rank-seconds: rollout ranks with no generation in flight while no task waits for
    admission (the staleness throttle holds rollout back), plus stalls a substrate reports whole
    (a weight sync pausing its engines), without counting a stalled stretch twice."""

    def __init__(self, now: float) -> None:
        self.total = 0.0
        self._at = now
        self._stall = (now, now)

    def advance(self, now: float, num_idle: int, is_counting: bool) -> None:
        since, self._at = self._at, now
        if now <= since or not is_counting:
            return
        lo, hi = self._stall
        overlap = max(0.0, min(now, hi) - max(since, lo)) if hi > since else 0.0
        self.total += (now - since - overlap) * num_idle

    def stall(self, now: float, until: float, num_ranks: int) -> None:
        self.total += (until - now) * num_ranks
        self._stall = (now, until)


class RolloutControl:
    """The book and its policy, fed by turn events; used alone by the simulator's single-GPU
    rollout experiment, and inside :class:`~tiderl.core.step_control.StepController`."""

    def __init__(self, policy: SchedulingPolicy, book: TaskBook, *, budget: int,
                 max_new_tokens: int, now: float = 0.0) -> None:
        self.policy, self.book = policy, book
        self.budget = budget  # B_r of a rank whose engine reported no capacity of its own
        self.rank_budgets: dict[int, int] = {}
        self.max_new_tokens = max_new_tokens
        self.generated_tokens = 0  # model output tokens of every reported turn
        self.rwt = RolloutWait(now)
        self.saturated_s = 0.0  # rank-seconds with tasks waiting for admission (see advance)
        self.generating_task_s = 0.0  # task-seconds of admitted tasks generating ...
        self.active_task_s = 0.0  # ... of the admitted tasks placed on a rank at all
        self._integrated_at = now
        self._marks = (0.0,) * 4  # the integrals at the last ``interval``
        self.is_parked = False  # a synchronous system's ranks are training, not rolling out
        self.num_pauses = 0  # CTB pauses so far ...
        self.num_releases = 0  # ... of them, releases of tasks waiting for their environment
        self.reused_tokens = 0  # of the context turns left for their task's next turn
        self.reusable_tokens = 0  # (reusable_tokens), what the next turn found cached

    @classmethod
    def of(cls, ctb: CTBConfig, *, budget: int, max_new_tokens: int, max_staleness: int = 0,
           tasks_per_step: int = 0, now: float = 0.0, block_tokens: int = 0) -> RolloutControl:
        """The policy ``ctb.policy`` names over a book with its weights and this staleness
        window (``tasks_per_step`` 0: none), on engines of KV blocks of ``block_tokens``."""
        book = ctb.new_book(max_staleness=max_staleness, tasks_per_step=tasks_per_step,
                            block_tokens=block_tokens)
        return cls(make_policy(ctb), book, budget=budget, max_new_tokens=max_new_tokens,
                   now=now)

    def budgets(self) -> dict[int, int]:
        """CTB's token budget B_r of every rank it places tasks on."""
        return {rank: record.budget for rank, record in self.book.ranks.items()}

    def footprint(self, context_tokens: int) -> int:
        """The KV tokens a task needs for its next turn: its context so far plus a whole
        generation (the next output's length is not known before it is generated)."""
        return context_tokens + self.max_new_tokens

    def tasks_per_rank(self) -> float:
        """How many tasks one rollout rank holds at once: its budget over the mean footprint of
        the tasks active now (0 with none active: not known yet)."""
        ranks = self.book.ranks.values()
        usage, num = sum(r.usage for r in ranks), sum(len(r.active) for r in ranks)
        if not ranks or not num or not usage:
            return 0.0
        return sum(r.budget for r in ranks) / len(ranks) / (usage / num)

    def advance(self, now: float) -> None:
        """RWT and the rollout's occupancy up to ``now``, for the predictive planner: the
        saturated rank-seconds (while tasks wait for admission, every rollout rank is full:
        the policy admits whenever one has room), and the task-seconds placed tasks spent
        generating against waiting for their environments."""
        book = self.book
        book.now = max(book.now, now)
        if now > self._integrated_at:
            if not self.is_parked:
                dt = now - self._integrated_at
                if book.num_new:
                    self.saturated_s += dt * len(book.ranks)
                self.generating_task_s += dt * book.num_generating
                self.active_task_s += dt * book.num_active
            self._integrated_at = now
        self.rwt.advance(now, book.num_idle_ranks, not self.is_parked and book.num_new == 0)

    def restart_clock(self, now: float) -> None:
        self.rwt = RolloutWait(now)
        self.saturated_s = self.generating_task_s = self.active_task_s = 0.0
        self._integrated_at, self._marks = now, (0.0,) * 4

    def interval(self) -> tuple[float, float, float | None]:
        """Since the last call (or the clock's start): RWT, the saturated rank-seconds and the
        share of placed task-seconds spent generating (None: no task was placed)."""
        marks = (self.rwt.total, self.saturated_s, self.generating_task_s, self.active_task_s)
        rwt, saturated, generating, active = (
            m - o for m, o in zip(marks, self._marks, strict=True))
        self._marks = marks
        return rwt, saturated, generating / active if active > 0 else None

    def is_known(self, task: str) -> bool:
        return task in self.book.tasks

    def is_admitted(self, task: str) -> bool:
        """In the book and placed (active or paused): a rank may report on it."""
        record = self.book.tasks.get(task)
        return record is not None and record.state is not _NEW

    def add_rank(self, rank: int, now: float) -> None:
        self.advance(now)
        self.book.add_rank(rank, self.rank_budgets.get(rank, self.budget))

    def set_rank_budget(self, rank: int, budget: int) -> None:
        """B_r of ``rank`` from now on (its engine's measured KV capacity): at once if it is a
        rollout rank, else when it joins."""
        self.rank_budgets[rank] = budget
        if rank in self.book.ranks:
            self.book.set_budget(rank, budget)

    def remove_rank(self, rank: int, now: float) -> tuple[str, ...]:
        """``rank`` leaves: the tasks active there, now paused with no rank."""
        self.advance(now)
        return tuple(self.book.remove_rank(rank))

    def set_prefill_rate(self, rank: int, tokens_per_s: float) -> None:
        """``rank``'s engine prefills this many tokens a second (measured): what recomputing a
        released task's context costs there (``ctb.release_waiting``)."""
        self.book.set_prefill_rate(rank, tokens_per_s)

    def add_group(self, group: Group, now: float) -> None:
        self.advance(now)
        self.book.add_group(group)

    def schedule(self, now: float) -> list[Decision]:
        """One CTB round: the policy's plan, applied to the book; an admitted or resumed task's
        next generation starts now."""
        self.advance(now)
        decisions = self.policy.schedule(self.book)
        if decisions:
            self.book.apply(decisions)
            for decision in decisions:
                if isinstance(decision, Admit | Resume):
                    self.book.set_running(decision.task_id, True)
                else:
                    self.num_pauses += 1
                    self.num_releases += decision.released
        return decisions

    def turn_started(self, task: str, now: float) -> None:
        """A task's observation came back: its next generation starts (unless it is paused:
        then it waits for a resume)."""
        self.advance(now)
        if task in self.book.tasks:  # is_known
            self.book.wait_ended(task, now)
            self.book.set_running(task, True)

    def turn_done(self, task: str, context_tokens: int, output_tokens: int, now: float, *,
                  reused: int = 0, reusable: int = 0, prompt_tokens: int | None = None) -> None:
        """A generation ended with the task's whole context at ``context_tokens``; the task now
        waits for its environment. ``reused`` of ``reusable``: what its prompt found cached of
        the context its previous turn left on the rank (KV retention). ``prompt_tokens``: the
        prompt its group's tasks share, read at its first turn (default: that turn's prompt,
        the same for every task of a group, which starts from one seed)."""
        if not 0 <= reused <= reusable:
            raise ValueError(f"a turn of task {short(task)} reused {reused!r} of {reusable!r} "
                             "tokens")
        self.advance(now)
        if not self.is_admitted(task):
            return
        self.generated_tokens += output_tokens
        if self.book.tasks[task].num_turns:
            prompt_tokens = None  # set by the group's first report
        elif prompt_tokens is None:
            prompt_tokens = context_tokens - output_tokens
        self.book.report_turn(task, self.footprint(context_tokens), context_tokens,
                              is_running=False, prompt_tokens=prompt_tokens)
        self.reused_tokens += reused
        self.reusable_tokens += reusable
        self.book.wait_started(task, now)

    def task_finished(self, task: str, now: float) -> bool:
        """False for a task the book does not hold as placed (one moved off a rank that died, or
        one never admitted)."""
        self.advance(now)
        if not self.is_admitted(task):
            return False
        self.book.finish_task(task)
        return True

    def stalled(self, now: float, until: float, num_ranks: int) -> None:
        """``num_ranks`` rollout engines cannot run from ``now`` to ``until``."""
        self.advance(now)
        self.rwt.stall(now, until, num_ranks)

    def park(self, now: float, is_parked: bool) -> None:
        self.advance(now)
        self.is_parked = is_parked
