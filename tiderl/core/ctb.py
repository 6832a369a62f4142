"""Continuous Task Batching (paper §4, Algorithm 1, Table 1) and the request-level baseline.

A policy reads a :class:`~tiderl.core.task_book.TaskBook` and returns a plan (Pauses, then
Resumes, then Admits); it never mutates the book, ``book.apply(plan)`` does. One CTB round::

    pause phase    per rank, while usage > budget and > 1 active task: pause argmin P(t)
    release phase  (``release_waiting``, off by default) while work waits for room: pause every
                   task whose environment's expected wait is longer than recomputing its context
    resume phase   paused tasks by descending P(t): group-affinity rank, else expected headroom
                   (a released task: once its environment answered, on its last rank first)
    admit phase    NEW tasks, FIFO by group: env sessions, staleness, probing, fit, diversity
                   (a group skips its probe while the ranks' expected headroom holds all of
                   it grown to F, the footprint finished tasks reached: ``Draft.holds``)

A task fits a rank when its footprint is within the headroom and, with ``project_growth``, the
rank's projected peak with it stays within the budget (:func:`projected_peak`: its tasks grow
until they reach the footprint finished tasks reached, then finish): contexts grow every turn,
so a rank filled to its budget by footprints now goes over it a turn later, and pauses.

A task waiting for its environment holds its KV for the wait. With ``release_waiting``, once a
paused task or a new group waits for room, CTB pauses (unpins) each waiting task whose expected
remaining wait (its environment's recent waits, :class:`~tiderl.core.task_book.WaitSamples`)
exceeds what recomputing its context costs on its rank (context / the rank's measured prefill
rate): budgets then count the KV of tasks that generate, and a released task whose environment
answers is resumed before any admission, on its last rank if it fits (its blocks stay cached there
until evicted). A task paused for the budget is resumed as before, its environment answered or
not (resuming it early keeps its place: on ``sim/cluster32``, holding every paused task until its
environment answered cost 2.3% of goodput).

Algorithm 1 in the paper loops rank-major (fill rank r with resumes, then admissions, then the
next rank). Here each phase runs task-major over all ranks, so that a task's affinity picks its
rank rather than the order ranks are visited in, and every resume precedes every admission.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from tiderl.core.config import require, require_choice, require_int
from tiderl.core.ctb_draft import Draft
from tiderl.core.footprints import FootprintModel, projected_peak
from tiderl.core.priority import PriorityWeights, priority
from tiderl.core.quote import short
from tiderl.core.staleness_window import StalenessWindow
from tiderl.core.task_book import GroupRecord, TaskBook, TaskRecord
from tiderl.core.types import Admit, Decision, Pause, Resume

__all__ = [
    "CTBConfig",
    "CTBPolicy",
    "PriorityWeights",
    "RequestLevelPolicy",
    "SchedulingPolicy",
    "TaskBook",
    "make_policy",
    "priority",
    "projected_peak",
]

# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class CTBConfig:
    """Rollout scheduling: the priority weights, budgets and admission constraints of CTB."""

    weights: PriorityWeights = field(default_factory=PriorityWeights)
    context_norm_tokens: int = 8192  # context length at which L_context saturates at 1
    budget_fraction: float = 0.9  # B_r = budget_fraction x the rank's KV capacity
    default_footprint_tokens: int = 512  # a task's, before a probe of its env measured one
    max_env_sessions: int = 0  # cap on open sessions (active + paused); 0 = unlimited
    diversity_penalty_tokens: int = 256  # per active task of the same env on a rank
    policy: str = "ctb"  # "ctb" | "request"
    request_concurrency: int = 64  # tasks per rank under the request-level baseline
    # Admit a new task on the rank holding most of its group (the shared prompt is cached there).
    # Off by default: the paper asks group affinity of resumes only, and concentrating whole
    # groups on one rank unbalances decode when KV is plentiful (docs/simulator.md, Fig. 8).
    admit_with_group: bool = False
    # Place a task only where the rank's projected peak (projected_peak) stays within B_r.
    project_growth: bool = True
    # While work waits for room, pause tasks whose environment wait outlasts their recompute.
    # Off by default: where KV is scarce the released tasks come back to evicted blocks
    # (bench/README.md, "CTB in real jobs": throughput -34%, hit rate 0.83 -> 0.40).
    release_waiting: bool = False
    # Probe a group's first turn even once its environment's first turn and F are measured
    # (false, the default: its tasks are placed by the projected peak at once, with
    # project_growth; measured in bench/README.md, "CTB in real jobs").
    probe_when_measured: bool = False
    # Before any task finished, take F as the growth bound where that is below the default:
    # the environments' first turns plus their growth per turn up to their turn limit.
    growth_bound: bool = True
    # Count a group's prompt once per rank: its tasks there share its full KV blocks (prefix
    # caching), so each but the first holds only what follows it.
    share_prompt: bool = True

    def __post_init__(self) -> None:
        require(isinstance(self.weights, PriorityWeights), "weights",
                f"expected PriorityWeights, got {short(self.weights)}")
        require_int(self.context_norm_tokens, "context_norm_tokens", minimum=1)
        require(
            0.0 < self.budget_fraction <= 1.0,
            "budget_fraction",
            f"expected a number in (0, 1], got {short(self.budget_fraction)}",
        )
        require_int(self.default_footprint_tokens, "default_footprint_tokens", minimum=1)
        require_int(self.max_env_sessions, "max_env_sessions", minimum=0)
        require_int(self.diversity_penalty_tokens, "diversity_penalty_tokens", minimum=0)
        require_choice(self.policy, tuple(_POLICIES), "policy")
        require_int(self.request_concurrency, "request_concurrency", minimum=1)

    def rank_budget(self, kv_capacity_tokens: int) -> int:
        """B_r for a rank whose KV cache holds ``kv_capacity_tokens``."""
        return int(kv_capacity_tokens * self.budget_fraction)

    def new_book(self, *, max_staleness: int = 0, tasks_per_step: int = 0,
                 block_tokens: int = 0) -> TaskBook:
        """An empty book that ranks tasks with these weights and probes with this default;
        ``block_tokens``: the engines' KV block (0: not known, no prompt counted as shared)."""
        return TaskBook(
            weights=self.weights,
            context_norm_tokens=self.context_norm_tokens,
            footprints=FootprintModel(self.default_footprint_tokens, self.growth_bound),
            window=StalenessWindow(max_staleness, tasks_per_step),
            prompt_block_tokens=block_tokens if self.share_prompt else 0,
        )


# --------------------------------------------------------------------------- policies


class SchedulingPolicy(ABC):
    """A rollout scheduling policy: ``schedule(book)`` returns a plan and mutates no book."""

    pins_tasks: ClassVar[bool]  # whether the runtime pins an active task's KV on its rank

    @property
    def releases_waiting(self) -> bool:
        """Whether it releases waiting tasks (then it reads prefill rates and environments'
        answers)."""
        return False

    @abstractmethod
    def schedule(self, book: TaskBook) -> list[Decision]: ...


class CTBPolicy(SchedulingPolicy):
    """Continuous Task Batching: token-budgeted admission, priority pausing, affinity resuming.

    Invariant: after its plan is applied no rank's usage exceeds its budget unless the rank holds
    a single active task, and no NEW task was admitted while a task paused before this round fit
    on some rank.

    Priorities P(t) are the book's (its weights: build it with ``CTBConfig.new_book``).
    Tie-breaks: pause the lowest (P(t), footprint, task_id), so at equal priority the smaller
    context goes, as Table 1's context tier would have it past the L_context cap; resume by
    highest P(t), then larger footprint, then lower task_id. A task paused in a round is not
    resumed in it. A paused task goes to the rank holding most of its group's active tasks where
    it fits (shared prefix), else to its last rank if it fits (its own context may be cached),
    else to the rank with most expected headroom. A new task goes to the rank maximising
    expected headroom - diversity penalty (with ``admit_with_group``: first to the rank holding
    most of its group); expected headroom counts each active task at least at the footprint
    finished tasks reached (:meth:`Draft.roomiest_rank`).
    """

    pins_tasks: ClassVar[bool] = True

    def __init__(self, config: CTBConfig):
        self.config = config

    @property
    def releases_waiting(self) -> bool:
        return self.config.release_waiting

    def schedule(self, book: TaskBook) -> list[Decision]:
        draft = Draft(book, self.config.project_growth)
        pauses = self._pause_phase(book, draft)
        draft.refresh()
        if self.releases_waiting:
            pauses += self._release_phase(book, draft, {d.task_id for d in pauses})
        resumes = self._resume_phase(book, draft)
        admits = self._admit_phase(book, draft)
        return [*pauses, *resumes, *admits]

    @staticmethod
    def _pause_phase(book: TaskBook, draft: Draft) -> list[Decision]:
        plan: list[Decision] = []
        for rank, record in book.ranks.items():
            if record.usage <= record.budget:
                continue
            victims = book.by_priority(rank)
            while draft.usage[rank] > record.budget and draft.num_active[rank] > 1:
                task = next(victims)
                draft.take_off(task)
                plan.append(Pause(task.task_id))
        return plan

    def _release_phase(self, book: TaskBook, draft: Draft,
                       paused: set[str]) -> list[Decision]:
        """While a paused task whose environment answered, or the first new group, fits on no
        rank: pause every active task waiting for its environment whose expected remaining wait
        exceeds its recompute time on its rank (tasks already paused this round aside)."""
        if not self._is_blocked(book, draft):
            return []
        plan: list[Decision] = []
        for record in book.ranks.values():
            for task in record.active.values():
                if task.waiting_since is None or task.task_id in paused:
                    continue
                wait, cost = book.expected_wait(task), book.recompute_s(task)
                if wait is not None and cost is not None and wait > cost:
                    draft.take_off(task)
                    plan.append(Pause(task.task_id, released=True))
        if plan:
            draft.no_fit.clear()  # room was made: what did not fit may now
            draft.refresh()
        return plan

    def _is_blocked(self, book: TaskBook, draft: Draft) -> bool:
        """Whether a resumable paused task, or the first admissible new group (not held back by
        the staleness window or the session cap), fits on no rank."""
        def fits_nowhere(footprint: int, task: TaskRecord | None = None) -> bool:
            shares = _shares(draft, book, task) if task else 0
            return not (draft.fits_somewhere(footprint, shares) and any(
                draft.fits(footprint, rank, draft.shared(task, rank) if task else 0)
                for rank in draft.usage))

        if any(_is_resumable(t) and fits_nowhere(t.footprint, t) for t in book.paused.values()):
            return True
        for group in book.pending_groups.values():
            estimate = book.admission_estimate(group)
            if estimate is None:
                continue
            first = book.admissible(group)[0]
            if self._is_env_full(draft) or _is_throttled(
                    book, draft.num_admitted_train + book.throttle_cost(first)):
                return False
            return fits_nowhere(estimate)
        return False

    @staticmethod
    def _resume_phase(book: TaskBook, draft: Draft) -> list[Decision]:
        """Paused tasks by (-P(t), -footprint, task_id) from a heap, so a round pops only the
        tasks it considers; it stops once the smallest candidate fits nowhere. A released task
        waits for its environment's answer."""
        largest = draft.largest_fit()
        resumable = [t for t in book.paused.values() if _is_resumable(t)]
        least = {t.task_id: t.footprint - _shares(draft, book, t) for t in resumable}  # its cost
        queue = [(-book.priority(t), -t.footprint, t.task_id, t) for t in resumable
                 if least[t.task_id] <= largest]
        if not queue:
            return []
        smallest = min(least[entry[2]] for entry in queue)
        heapq.heapify(queue)
        plan: list[Decision] = []
        # tasks that fit nowhere, by group: a sibling resumed later may share their prompt
        skipped: dict[str, list] = {}
        while queue and draft.largest_fit() >= smallest:
            entry = heapq.heappop(queue)
            task = entry[3]
            shared = _shares(draft, book, task)
            rank = (_resume_rank(task, book, draft)
                    if draft.fits_somewhere(task.footprint, shared) else None)
            if rank is None:
                draft.fits_nowhere(task.footprint, shared)
                skipped.setdefault(task.group_id, []).append(entry)
                continue
            draft.put_on(task, rank)
            plan.append(Resume(task.task_id, rank))
            if book.group_of(task).prompt_tokens:  # its siblings skipped may fit now
                for again in skipped.pop(task.group_id, ()):
                    heapq.heappush(queue, again)
                    smallest = min(smallest, again[3].footprint - _shares(draft, book, again[3]))
        return plan

    def _admit_phase(self, book: TaskBook, draft: Draft) -> list[Decision]:
        """NEW tasks by group, FIFO; a group's admissible tasks share one footprint estimate."""
        plan: list[Decision] = []
        largest = draft.largest_fit()
        for group in book.pending_groups.values():
            estimate = book.admission_estimate(group)
            if estimate is None:
                continue
            shared = draft.group_shares(group)
            if estimate - shared > largest or (not shared and (None, estimate, 0) in draft.no_fit):
                continue  # O(1) per group that cannot be admitted (most): this loop is hot
            if self._is_env_full(draft):
                break
            plan += self._admit_group(book, group, draft)
            largest = draft.largest_fit()
        return plan

    def _admit_group(self, book: TaskBook, group: GroupRecord, draft: Draft) -> list[Decision]:
        plan: list[Decision] = []
        tasks = book.admissible(group)
        if not group.is_probed and not self._probes(book, group, draft):
            tasks = [book.tasks[task_id] for task_id in group.pending]
        for task in tasks:
            shared = draft.group_shares(group)
            if self._is_env_full(draft) or not draft.fits_somewhere(task.footprint, shared):
                break
            cost = 0 if group.group_id in draft.reserved else book.throttle_cost(task)
            if _is_throttled(book, draft.num_admitted_train + cost):
                break  # the group's whole reservation does not fit in the staleness window
            rank = draft.sibling_rank(task) if self.config.admit_with_group else None
            if rank is None:
                rank = draft.roomiest_rank(task, self.config.diversity_penalty_tokens)
            if rank is None:  # every rank's projected peak refuses it
                draft.fits_nowhere(task.footprint, shared)
                break
            draft.put_on(task, rank)
            draft.num_open += 1
            draft.num_admitted_train += cost
            if not task.is_eval:
                draft.reserved.add(group.group_id)
            plan.append(Admit(task.task_id, rank))
        return plan

    def _probes(self, book: TaskBook, group: GroupRecord, draft: Draft) -> bool:
        """Whether an unprobed group offers its probe alone: not where probing protects no
        budget, as the headroom holds the group grown to F, or (``probe_when_measured`` off)
        each of its tasks is placed by the projected peak from measured figures."""
        if draft.holds(len(group.pending)):
            return False
        return self.config.probe_when_measured or not draft.projects(
            book.tasks[group.probe_task_id])

    def _is_env_full(self, draft: Draft) -> bool:
        cap = self.config.max_env_sessions
        return cap > 0 and draft.num_open >= cap


def _shares(draft: Draft, book: TaskBook, task: TaskRecord) -> int:
    return draft.group_shares(book.group_of(task))


def _is_resumable(task: TaskRecord) -> bool:
    """Paused for the budget, or released and its environment answered."""
    return not task.is_released or task.waiting_since is None


def _resume_rank(task: TaskRecord, book: TaskBook, draft: Draft) -> int | None:
    """Its group's rank, else its last rank, else the most expected headroom; a released task
    its last rank first (its context stays cached there until evicted); None when every rank's
    projected peak refuses it."""
    def fits_last() -> bool:
        return task.rank in book.ranks and draft.fits(task.footprint, task.rank,
                                                      draft.shared(task, task.rank))

    if task.is_released and fits_last():
        return task.rank
    rank = draft.sibling_rank(task)
    if rank is None and fits_last():
        rank = task.rank
    if rank is None:
        rank = draft.roomiest_rank(task, penalty=0)
    return rank


def _is_throttled(book: TaskBook, num_admitted_train: int) -> bool:
    """Whether that many admitted training tasks would exceed the staleness window (eval tasks
    cost nothing: they run on an anchored version)."""
    limit = book.train_admission_limit
    return limit is not None and num_admitted_train > limit


class RequestLevelPolicy(SchedulingPolicy):
    """The baseline: request-level rollout with a fixed number of tasks per rank.

    Invariant: it never places a task on a rank already holding ``request_concurrency`` active
    tasks. Ranks are taken round-robin; it never pauses, ignores token budgets and probing, and
    keeps the environment-session cap and the staleness throttle (they are not about KV). It
    resumes only the tasks that ``remove_rank`` orphaned, before admitting new ones.
    """

    pins_tasks: ClassVar[bool] = False

    def __init__(self, config: CTBConfig):
        self.config = config
        self._last_rank: int | None = None  # the round-robin cursor

    def schedule(self, book: TaskBook) -> list[Decision]:
        limit = self.config.request_concurrency
        slots = {r: limit - len(rec.active) for r, rec in book.ranks.items()}
        plan: list[Decision] = []
        for task in book.paused.values():
            rank = self._next_rank(slots)
            if rank is None:
                return plan
            plan.append(Resume(task.task_id, rank))
        return plan + self._admissions(book, slots)

    def _admissions(self, book: TaskBook, slots: dict[int, int]) -> list[Decision]:
        cap = self.config.max_env_sessions
        num_open, num_train = book.num_open_sessions, book.num_admitted_train
        reserved: set[str] = set()
        plan: list[Decision] = []
        for task in book.new_tasks():
            cost = 0 if task.group_id in reserved else book.throttle_cost(task)
            if _is_throttled(book, num_train + cost):
                continue
            rank = None if cap and num_open >= cap else self._next_rank(slots)
            if rank is None:
                break
            plan.append(Admit(task.task_id, rank))
            num_open += 1
            num_train += cost
            if not task.is_eval:
                reserved.add(task.group_id)
        return plan

    def _next_rank(self, slots: dict[int, int]) -> int | None:
        """The first rank after the cursor (wrapping round) with a free slot; takes the slot."""
        free = [r for r, n in slots.items() if n > 0]
        if not free:
            return None
        after = [r for r in free if self._last_rank is None or r > self._last_rank]
        rank = after[0] if after else free[0]
        slots[rank] -= 1
        self._last_rank = rank
        return rank


_POLICIES: dict[str, type[CTBPolicy | RequestLevelPolicy]] = {
    "ctb": CTBPolicy,
    "request": RequestLevelPolicy,
}


def make_policy(config: CTBConfig) -> SchedulingPolicy:
    """The policy that ``config.policy`` names."""
    return _POLICIES[config.policy](config)
