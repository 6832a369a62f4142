"""CTB invariants on random books: budgets, resume-before-admit, tiers, affinity, purity."""

from __future__ import annotations

import copy
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from tiderl.core.ctb import CTBConfig, CTBPolicy, TaskBook, priority, projected_peak
from tiderl.core.env_waits import WaitSamples
from tiderl.core.task_book import RankRecord, TaskRecord
from tiderl.core.types import Admit, Group, Pause, Resume, Task, TaskState

ENVS = ("shop", "alf", "guess")
# 100 books per property (about half a second each here); an example is a few milliseconds, so
# 5 s only catches a pathological one, never a loaded machine
PROPERTY = settings(max_examples=100)


@st.composite
def scenarios(draw) -> tuple[TaskBook, CTBConfig]:
    """A book reached through ordinary events, possibly over budget, with every task state."""
    config = CTBConfig(
        max_env_sessions=draw(st.sampled_from([0, 0, 5, 20])),
        diversity_penalty_tokens=draw(st.sampled_from([0, 256, 1000])),
        release_waiting=draw(st.booleans()),
    )
    book = config.new_book(
        max_staleness=draw(st.integers(0, 2)), tasks_per_step=draw(st.sampled_from([0, 0, 3, 8])),
        block_tokens=draw(st.sampled_from([0, 1, 16])),  # 0: no prompt shared
    )
    for rank in range(draw(st.integers(1, 6))):
        book.add_rank(rank, draw(st.integers(0, 4000)))
        if draw(st.booleans()):  # a measured prefill rate: its waiting tasks may be released
            book.set_prefill_rate(rank, draw(st.sampled_from([100.0, 2000.0, 50_000.0])))
    for env in draw(st.sets(st.sampled_from(ENVS))):  # measured waits
        for wait in draw(st.lists(st.floats(0.0, 20.0), min_size=1, max_size=8)):
            book.waits.setdefault(env, WaitSamples()).add(wait)
    book.now = 10.0
    group_size = draw(st.integers(1, 8))  # GRPO: one group size
    for g in range(draw(st.integers(0, 8))):
        _add_group(draw, book, f"g{g}", group_size)
    if len(book.ranks) > 1 and draw(st.booleans()):
        book.remove_rank(draw(st.sampled_from(book.rank_ids)))
    return book, config


def _add_group(draw, book: TaskBook, group_id: str, size: int) -> None:
    env, is_eval = draw(st.sampled_from(ENVS)), draw(st.integers(0, 4)) == 0
    hint = draw(st.none() | st.integers(0, 2000))
    specs = [Task(f"{group_id}-{i}", group_id, env, is_eval, hint) for i in range(size)]
    book.add_group(Group(group_id, tuple(specs)))
    prompt = draw(st.integers(0, 600))  # every task's context starts with the group's prompt
    for spec in specs:
        fate = draw(st.sampled_from(["new", "active", "active", "paused", "finished"]))
        if fate == "new":
            continue
        book.apply([Admit(spec.task_id, draw(st.sampled_from(book.rank_ids)))])
        footprint, context = draw(st.integers(prompt, 2500)), draw(st.integers(0, 10_000))
        is_running = draw(st.booleans())
        book.report_turn(spec.task_id, footprint, context, is_running=is_running,
                         prompt_tokens=draw(st.sampled_from([None, prompt])))
        if not is_running and draw(st.booleans()):  # its environment works on its action
            book.wait_started(spec.task_id, draw(st.floats(0.0, 10.0)))
        if fate == "paused":
            book.apply([Pause(spec.task_id, released=draw(st.booleans()))])
        elif fate == "finished":
            book.finish_task(spec.task_id)


def fits(book: TaskBook, rank: RankRecord, task: TaskRecord) -> bool:
    """The policy's notion of fitting a task not active: within headroom (less the prompt its
    group's tasks there share) with the projected peak within the budget, or alone on an empty
    rank with a budget."""
    footprint, group = task.footprint, book.group_of(task)
    cost = footprint - (group.prompt_tokens if rank.rank in group.num_active_on else 0)
    if not rank.active:
        return cost <= rank.headroom or rank.budget > 0
    footprints = sorted([*(t.footprint for t in rank.active.values()), footprint])
    shared_now = sum(footprints) - rank.usage - cost  # what the rank's tasks share, with it
    return (cost <= rank.headroom
            and projected_peak(footprints, book.expected_footprint) - shared_now <= rank.budget)


def held(book: TaskBook, rank: RankRecord) -> int:
    """What a rank's active tasks hold: their footprints, each group's prompt once."""
    groups = {t.group_id for t in rank.active.values()}
    return (sum(t.footprint for t in rank.active.values())
            - sum(book.groups[g].prompt_tokens * (book.groups[g].num_active_on[rank.rank] - 1)
                  for g in groups))


def is_resumable(task: TaskRecord) -> bool:
    """Paused for the budget, or released and its environment answered."""
    return not task.is_released or task.waiting_since is None


def applied(book: TaskBook, decisions: list) -> TaskBook:
    after = copy.deepcopy(book)
    after.apply(decisions)
    return after


@PROPERTY
@given(scenarios())
def test_no_rank_ends_over_budget_unless_it_holds_a_single_task(scenario):
    book, config = scenario
    after = applied(book, CTBPolicy(config).schedule(book))
    for rank in after.ranks.values():
        assert rank.usage <= rank.budget or len(rank.active) == 1
        assert rank.usage == held(after, rank)


@PROPERTY
@given(scenarios())
def test_every_task_left_paused_fits_nowhere_once_resumes_are_done(scenario):
    book, config = scenario
    plan = CTBPolicy(config).schedule(book)
    after_resumes = applied(book, [d for d in plan if not isinstance(d, Admit)])
    paused_this_round = {d.task_id for d in plan if isinstance(d, Pause)}
    for task in after_resumes.paused.values():
        if task.task_id not in paused_this_round and is_resumable(task):
            assert not any(fits(after_resumes, rank, task)
                           for rank in after_resumes.ranks.values())


@PROPERTY
@given(scenarios())
def test_plan_is_pauses_then_resumes_then_admits(scenario):
    book, config = scenario
    kinds = [type(d) for d in CTBPolicy(config).schedule(book)]
    assert kinds == sorted(kinds, key=[Pause, Resume, Admit].index)


@PROPERTY
@given(scenarios())
def test_pauses_follow_priority_and_spare_eval_tasks(scenario):
    """Per rank, pauses are exactly the lowest (P(t), footprint, task_id) tasks, as few as needed;
    an eval task is paused only when no train task is left active on its rank."""
    book, config = scenario
    paused = [d.task_id for d in CTBPolicy(config).schedule(book)
              if isinstance(d, Pause) and not d.released]
    for rank in book.ranks.values():
        order = sorted(
            rank.active.values(), key=lambda t: (_priority(book, t), t.footprint, t.task_id)
        )
        state, expected = copy.deepcopy(book), []  # a pause frees what its task holds alone
        while state.ranks[rank.rank].usage > rank.budget and len(order) - len(expected) > 1:
            expected.append(order[len(expected)].task_id)
            state.apply([Pause(expected[-1])])
        assert [t for t in paused if book.task(t).rank == rank.rank] == expected
        kept = [t for t in order if t.task_id not in expected]
        if any(book.task(t).is_eval for t in expected):
            assert all(t.is_eval for t in kept)


@PROPERTY
@given(scenarios())
def test_placements_honour_group_affinity(scenario):
    """Replayed one by one: a Resume (and an Admit with admit_with_group) goes to the rank holding
    most of its group's active tasks (ties: lower id) whenever that rank has room."""
    book, config = scenario
    config = replace(config, admit_with_group=True)
    state = copy.deepcopy(book)
    for decision in CTBPolicy(config).schedule(book):
        if not isinstance(decision, Pause):
            task = state.task(decision.task_id)
            counts = state.group_of(task).num_active_on
            last = state.ranks.get(task.rank) if task.rank is not None else None
            if task.is_released and last is not None and fits(state, last, task):
                assert decision.rank == task.rank  # its own context is cached there
            elif counts:
                preferred = min(counts, key=lambda r: (-counts[r], r))
                if fits(state, state.ranks[preferred], task):
                    assert decision.rank == preferred
            assert fits(state, state.ranks[decision.rank], task)
        state.apply([decision])


@PROPERTY
@given(scenarios())
def test_admissions_respect_probing_sessions_and_staleness(scenario):
    book, config = scenario
    plan = CTBPolicy(config).schedule(book)
    after = applied(book, plan)
    for decision in plan:
        if isinstance(decision, Admit):
            group = book.group_of(book.task(decision.task_id))
            if not group.is_probed and decision.task_id != group.probe_task_id:
                # a group skips its probe only once F is measured (CTB's Draft.holds)
                assert book.is_footprint_measured and book.expected_footprint > 0
    if config.max_env_sessions:
        assert after.num_open_sessions <= max(config.max_env_sessions, book.num_open_sessions)
    if book.train_admission_limit is not None:
        limit = max(book.train_admission_limit, book.num_admitted_train)
        assert after.num_admitted_train <= limit


@PROPERTY
@given(scenarios())
def test_releases_are_of_tasks_whose_wait_outlasts_their_recompute(scenario):
    """A released task was active and waiting for its environment longer than recomputing its
    context takes on its rank; a released task still waiting is never resumed; with
    ``release_waiting`` off nothing is released."""
    book, config = scenario
    plan = CTBPolicy(config).schedule(book)
    for decision in plan:
        task = book.task(decision.task_id)
        if isinstance(decision, Pause) and decision.released:
            assert task.state is TaskState.ACTIVE and task.waiting_since is not None
            assert book.expected_wait(task) > book.recompute_s(task)
        elif isinstance(decision, Resume):
            assert is_resumable(task)
    off = CTBPolicy(replace(config, release_waiting=False)).schedule(book)
    assert not any(isinstance(d, Pause) and d.released for d in off)


@PROPERTY
@given(scenarios())
def test_schedule_is_pure_and_deterministic(scenario):
    book, config = scenario
    before = copy.deepcopy(book)
    plan = CTBPolicy(config).schedule(book)
    assert book == before
    assert CTBPolicy(config).schedule(book) == plan
    assert CTBPolicy(config).schedule(before) == plan


@PROPERTY
@given(scenarios())
def test_book_indexes_match_a_recount(scenario):
    book, _ = scenario
    for rank in book.ranks.values():
        assert rank.usage == held(book, rank)
        assert rank.footprints == sorted(t.footprint for t in rank.active.values())
        assert all(
            t.state is TaskState.ACTIVE and t.rank == rank.rank for t in rank.active.values()
        )
        assert sorted(t.task_id for t in book.by_priority(rank.rank)) == sorted(rank.active)
    assert book.num_active == sum(len(r.active) for r in book.ranks.values())
    assert book.num_new == sum(t.state is TaskState.NEW for t in book.tasks.values())
    for task in book.tasks.values():
        assert book.priority(task) == _priority(book, task)


def _priority(book: TaskBook, task: TaskRecord) -> float:
    return priority(task, book.group_of(task), book.weights, book.context_norm_tokens)
