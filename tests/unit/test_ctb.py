"""CTB (paper Algorithm 1) and the request-level baseline on hand-built books, exact decisions."""

from __future__ import annotations

import pytest

from tiderl.core.config import ConfigError
from tiderl.core.ctb import (
    CTBConfig,
    CTBPolicy,
    PriorityWeights,
    RequestLevelPolicy,
    TaskBook,
    make_policy,
    priority,
    projected_peak,
)
from tiderl.core.types import Admit, Group, Pause, Resume, Task, TaskState


def make_book(budgets: list[int], config: CTBConfig | None = None, **kwargs: int) -> TaskBook:
    book = (config or CTBConfig()).new_book(**kwargs)
    for rank, budget in enumerate(budgets):
        book.add_rank(rank, budget)
    return book


def add(
    book: TaskBook,
    group_id: str,
    size: int = 1,
    env: str = "shop",
    is_eval: bool = False,
    hint: int | None = None,
) -> list[str]:
    """Queue a group whose tasks are named group_id + index."""
    tasks = tuple(Task(f"{group_id}{i}", group_id, env, is_eval, hint) for i in range(size))
    book.add_group(Group(group_id, tasks))
    return [task.task_id for task in tasks]


def run(
    book: TaskBook, task_id: str, rank: int, footprint: int, context: int = 0, running=False
) -> None:
    """Admit a task on ``rank`` (whatever a policy would say) and report its first turn."""
    book.apply([Admit(task_id, rank)])
    book.report_turn(task_id, footprint, context, is_running=running)


def schedule(book: TaskBook, config: CTBConfig | None = None) -> list:
    return CTBPolicy(config or CTBConfig()).schedule(book)


# placement by headroom alone: the books below admit before any task finished, so with
# project_growth each task would count as growing to the default 512 tokens
NO_GROWTH = CTBConfig(project_growth=False)


# --------------------------------------------------------------------------- pausing


def test_over_budget_pauses_the_task_of_the_least_complete_group():
    book = make_book([1000])
    add(book, "a", size=2)
    run(book, "a0", 0, 100)
    book.finish_task("a0")  # a: 1/2 complete
    run(book, "a1", 0, 500)
    add(book, "b", size=4)
    run(book, "b0", 0, 50)
    book.finish_task("b0")  # b: 1/4 complete
    run(book, "b1", 0, 400)
    add(book, "c", size=4)
    run(book, "c0", 0, 400)  # c: 0/4 complete
    for task_id in ["b2", "b3", "c1", "c2", "c3"]:
        book.drop_task(task_id)  # no NEW task left to admit
    assert book.ranks[0].usage == 1300  # 300 over budget

    assert schedule(book) == [Pause("c0")]


def test_eval_task_is_kept_over_a_train_task():
    book = make_book([1000])
    add(book, "e", is_eval=True)
    run(book, "e0", 0, 600)
    add(book, "t", size=2)
    run(book, "t0", 0, 10)
    book.finish_task("t0")
    run(book, "t1", 0, 600, context=9000, running=True)  # every lower tier maxed out

    assert schedule(book) == [Pause("t1")]


def test_running_task_is_kept_over_a_waiting_one_at_equal_completion():
    book = make_book([1000])
    add(book, "w")
    run(book, "w0", 0, 600, context=8192)  # waiting for its environment, long context
    add(book, "r")
    run(book, "r0", 0, 600, context=0, running=True)

    assert schedule(book) == [Pause("w0")]


def test_longer_context_is_kept_when_all_else_is_equal():
    book = make_book([1000])
    add(book, "s")
    run(book, "s0", 0, 600, context=100)
    add(book, "l")
    run(book, "l0", 0, 600, context=4000)

    assert schedule(book) == [Pause("s0")]


def test_equal_priority_pauses_the_smaller_footprint_then_the_lower_task_id():
    book = make_book([900])
    for group_id, footprint in [("b", 500), ("a", 500), ("c", 300)]:
        add(book, group_id)
        run(book, f"{group_id}0", 0, footprint)
    assert book.ranks[0].usage == 1300

    assert schedule(book) == [Pause("c0"), Pause("a0")]


def test_never_pauses_the_last_task_on_a_rank():
    book = make_book([100])
    add(book, "a")
    run(book, "a0", 0, 500)

    assert schedule(book) == []


def test_a_task_paused_this_round_is_not_resumed_in_it():
    book = make_book([1000, 5000])
    add(book, "a")
    run(book, "a0", 0, 600)
    add(book, "b")
    run(book, "b0", 0, 600)

    assert schedule(book) == [Pause("a0")]


def test_pausing_tracks_usage_across_turns_and_finishes():
    book = make_book([1000])
    add(book, "a")
    run(book, "a0", 0, 400)
    add(book, "b")
    run(book, "b0", 0, 400)
    book.report_turn("a0", 700, 700)  # grows: 1100 > 1000
    assert schedule(book) == [Pause("b0")]
    book.finish_task("a0")
    assert book.ranks[0].usage == 400
    assert schedule(book) == []


# --------------------------------------------------------------------------- resuming


def test_resume_comes_before_admission():
    book = make_book([1000])
    add(book, "x")
    run(book, "x0", 0, 400)
    add(book, "p")
    run(book, "p0", 0, 500)
    book.apply([Pause("p0")])
    add(book, "n")  # estimate: the default 512 tokens

    assert schedule(book) == [Resume("p0", 0)]  # 100 tokens left: n0 waits
    book.set_budget(0, 2000)
    assert schedule(book) == [Resume("p0", 0), Admit("n0", 0)]


def test_a_new_task_is_admitted_when_no_paused_task_fits():
    book = make_book([1000])
    add(book, "x")
    run(book, "x0", 0, 400)
    add(book, "p")
    run(book, "p0", 0, 800)
    book.apply([Pause("p0")])
    add(book, "n", hint=300)

    assert schedule(book) == [Admit("n0", 0)]


def test_resumes_go_by_descending_priority_and_skip_what_does_not_fit():
    book = make_book([1000, 1000])
    add(book, "x")
    run(book, "x0", 0, 400)
    run_then_pause = [("lo", 500, 0), ("hi", 900, 5000), ("mid", 300, 2000)]
    for group_id, footprint, context in run_then_pause:
        add(book, group_id)
        run(book, f"{group_id}0", 1, footprint, context)
        book.apply([Pause(f"{group_id}0")])

    # hi0 takes rank 1 (its last rank); lo0 (500) fits nowhere then, mid0 (300) fits on rank 0.
    assert schedule(book) == [Resume("hi0", 1), Resume("mid0", 0)]


def _affinity_book() -> TaskBook:
    """Group g: two active tasks on rank 1, one on rank 2, g3 paused (last rank 0)."""
    book = make_book([1000, 1000, 1000, 1000])
    add(book, "g", size=4)
    for task_id, rank in [("g0", 1), ("g1", 1), ("g2", 2), ("g3", 0)]:
        run(book, task_id, rank, 100)
    book.apply([Pause("g3")])
    return book


def _fill(book: TaskBook, rank: int, footprint: int) -> None:
    group_id = f"fill{rank}"
    add(book, group_id, env="alf")
    run(book, f"{group_id}0", rank, footprint)


def test_resume_goes_to_the_rank_holding_most_of_its_group():
    book = _affinity_book()
    _fill(book, 3, 100)  # rank 3 has the most headroom, rank 0 is its last rank

    assert schedule(book, NO_GROWTH) == [Resume("g3", 1)]


def test_resume_falls_back_to_the_next_group_rank_then_its_last_rank_then_most_headroom():
    book = _affinity_book()
    _fill(book, 1, 750)  # rank 1: 50 left
    assert schedule(book, NO_GROWTH) == [Resume("g3", 2)]
    _fill(book, 2, 850)  # rank 2: 50 left
    assert schedule(book, NO_GROWTH) == [Resume("g3", 0)]
    _fill(book, 0, 950)  # rank 0: 50 left
    _fill(book, 3, 100)
    assert schedule(book, NO_GROWTH) == [Resume("g3", 3)]


def test_removed_rank_pauses_its_tasks_without_a_rank_and_they_resume_elsewhere():
    book = make_book([1000, 1000])
    add(book, "a", size=2)
    run(book, "a0", 0, 300)
    run(book, "a1", 0, 200)
    add(book, "b")
    run(book, "b0", 1, 300)

    assert book.remove_rank(0) == ["a0", "a1"]
    assert book.rank_ids == (1,)
    assert (book.task("a0").state, book.task("a0").rank) == (TaskState.PAUSED, None)
    assert (book.num_active, book.num_paused, book.ranks[1].usage) == (1, 2, 300)
    assert schedule(book, NO_GROWTH) == [Resume("a0", 1), Resume("a1", 1)]


def test_a_task_larger_than_every_budget_runs_alone_on_an_empty_rank():
    book = make_book([1000, 1000])
    add(book, "x")
    run(book, "x0", 0, 100)
    add(book, "big")
    run(book, "big0", 1, 5000)
    book.apply([Pause("big0")])

    assert schedule(book) == [Resume("big0", 1)]


# --------------------------------------------------------------------------- admission


def test_first_turn_probing():
    book = make_book([10_000, 10_000])
    add(book, "g", size=3)

    assert schedule(book) == [Admit("g0", 0)]  # the probe alone, at the default 512 tokens
    book.apply([Admit("g0", 0)])
    assert book.ranks[0].usage == 512
    assert schedule(book) == []  # siblings wait for the probe's first turn

    book.report_turn("g0", 700, 650)
    assert book.group_of(book.task("g0")).probed_footprint == 700
    plan = schedule(book)
    assert plan == [Admit("g1", 1), Admit("g2", 0)]  # the probed footprint, most headroom
    with_group = CTBConfig(admit_with_group=True)
    assert schedule(book, with_group) == [Admit("g1", 0), Admit("g2", 0)]  # the shared prefix
    book.apply(plan)
    assert (book.ranks[0].usage, book.ranks[1].usage) == (2 * 700, 700)

    book.report_turn("g1", 900, 850)  # every turn updates the footprint
    book.report_turn("g0", 1000, 950)  # later turns of the probe do not change the estimate
    assert (book.ranks[0].usage, book.ranks[1].usage) == (1000 + 700, 900)
    assert book.group_of(book.task("g0")).probed_footprint == 700


def test_unprobed_tasks_are_admitted_at_their_environments_mean_probed_first_turn():
    book = make_book([1000])
    for group_id in "abcd":
        add(book, group_id, size=2)
    add(book, "w", size=2, env="web")
    add(book, "h", hint=300)

    # before any probe reported: the default, one probe fits (then h's hint, 300 of 488 left)
    assert schedule(book, NO_GROWTH) == [Admit("a0", 0), Admit("h0", 0)]
    book.apply([Admit("a0", 0)])
    book.report_turn("a0", 200, 150)  # shop's first turns: 200 tokens
    assert book.footprints.first_turn("shop") == 200
    assert [book.task(f"{g}{i}").footprint for g in "bcd" for i in range(2)] == [200] * 6
    assert (book.task("w0").footprint, book.task("h0").footprint) == (512, 300)  # web: no probe

    # a's sibling at a's own 200, then three probes at 200: 1,000 tokens; w0's 512 waits
    assert schedule(book, NO_GROWTH) == [
        Admit("a1", 0), Admit("b0", 0), Admit("c0", 0), Admit("d0", 0)]
    book.apply([Admit("b0", 0)])
    book.report_turn("b0", 400, 350)  # mean of 200 and 400
    assert [book.task(t).footprint for t in ("b1", "c0", "c1", "d0", "d1")] == [
        400, 300, 300, 300, 300]
    add(book, "e")
    assert book.task("e0").footprint == 300
    book.report_turn("b0", 900, 850)  # a probe's later turns are not first turns
    assert book.footprints.first_turn("shop") == 300


def test_a_group_skips_its_probe_when_the_headroom_holds_it_grown_to_the_measured_footprint():
    # F = 1000 measured (a task finished there); two ranks of 2,600 hold 2 + 2 tasks grown to F
    book = make_book([2_600, 2_600])
    add(book, "done")
    run(book, "done0", 0, 1000)
    book.finish_task("done0")
    add(book, "g", size=4)
    add(book, "h", size=4)

    # g's probe and its siblings together, at the 1,000 tokens done's probe measured, by
    # expected headroom;
    # then h does not fit grown to F (no rank keeps 1,000 over 2 x F): it probes, and its probe
    # alone fits neither rank's projected peak
    assert schedule(book) == [Admit("g0", 0), Admit("g1", 1), Admit("g2", 0), Admit("g3", 1)]
    # before any task finished F is a guess: the probe goes alone (test_first_turn_probing)
    fresh = make_book([2_600, 2_600])
    add(fresh, "g", size=4)
    assert schedule(fresh) == [Admit("g0", 0)]


def test_a_group_may_skip_its_probe_once_its_first_turn_and_growth_are_measured():
    book = make_book([1000])
    add(book, "done")
    run(book, "done0", 0, 100)  # shop's first turns: 100 tokens
    book.report_turn("done0", 300, 250)
    book.finish_task("done0")  # F = 300
    add(book, "g", size=4)
    add(book, "w", size=2, env="web")

    # The headroom does not hold g grown to F (4 x 300 > 1,000), yet its tasks need no probe:
    # each is placed by the projected peak (3 x 300 <= 1,000). web's first turn is unmeasured:
    # w's probe goes alone, at the default 512 (the projected peak 900, w0 at F already).
    assert schedule(book) == [Admit("g0", 0), Admit("g1", 0), Admit("g2", 0), Admit("w0", 0)]
    # with probe_when_measured, and without the projection (the probe is what protects the
    # budget), g probes
    assert schedule(book, CTBConfig(probe_when_measured=True)) == [Admit("g0", 0), Admit("w0", 0)]
    no_growth = CTBConfig(project_growth=False, probe_when_measured=False)
    assert schedule(book, no_growth) == [Admit("g0", 0), Admit("w0", 0)]


def test_probe_uses_its_hint_and_is_skipped_when_it_does_not_fit():
    book = make_book([1000])
    add(book, "x")
    run(book, "x0", 0, 100)
    add(book, "big", hint=2000)
    add(book, "small", size=2, hint=300)

    assert schedule(book) == [Admit("small0", 0)]  # the scan goes on past a group that fits nowhere


def test_dropped_probe_hands_probing_to_the_next_task():
    book = make_book([10_000])
    add(book, "g", size=3)
    book.apply([Admit("g0", 0)])
    book.drop_task("g0")

    assert schedule(book) == [Admit("g1", 0)]


def test_environment_session_cap_counts_active_and_paused_tasks():
    config = CTBConfig(max_env_sessions=3)
    book = make_book([10_000], config)
    add(book, "x")
    run(book, "x0", 0, 100)
    add(book, "p")
    run(book, "p0", 0, 20_000)
    book.apply([Pause("p0")])
    for group_id in ["n", "m", "o"]:
        add(book, group_id, hint=512)

    assert schedule(book, config) == [Admit("n0", 0)]


def test_staleness_throttle_admits_an_exact_count_and_exempts_eval():
    book = make_book([100_000], tasks_per_step=2, max_staleness=1)  # limit (0 + 1 + 1) * 2 = 4
    for i in range(6):
        add(book, f"t{i}-")
    add(book, "e", is_eval=True)

    plan = schedule(book)
    assert plan == [Admit(f"t{i}-0", 0) for i in range(4)] + [Admit("e0", 0)]
    book.apply(plan)
    assert book.num_admitted_train == 4
    assert schedule(book) == []
    book.retire(2)  # one step of 2 trained: limit 2 + (1 + 1) * 2 = 6
    assert schedule(book) == [Admit("t4-0", 0), Admit("t5-0", 0)]
    book.set_tasks_per_step(1)  # an elastic batch of 1: limit 2 + 2 = 4, nothing more
    book.apply(schedule(book))
    add(book, "late-")
    assert schedule(book) == []
    with pytest.raises(ValueError):
        book.retire(-1)


def test_staleness_throttle_reserves_whole_groups():
    book = make_book([100_000], tasks_per_step=2, max_staleness=1)  # limit 4
    add(book, "a", size=3)
    add(book, "b", size=3)
    plan = schedule(book)
    assert plan == [Admit("a0", 0)]  # a's probe reserves a0-a2; b (3 more) would exceed 4
    book.apply(plan)
    assert book.num_admitted_train == 3
    book.report_turn("a0", 100, 50)  # the probe's first turn: its siblings follow, unthrottled
    assert schedule(book) == [Admit("a1", 0), Admit("a2", 0)]
    book.apply(schedule(book))
    assert book.num_admitted_train == 3
    book.retire(3)
    assert schedule(book) == [Admit("b0", 0)]


def test_diversity_penalty_changes_the_rank_choice():
    def build(config: CTBConfig) -> TaskBook:
        book = make_book([10_000, 10_000], config)
        for group_id, env, rank in [("s", "shop", 0), ("t", "shop", 0), ("u", "alf", 1)]:
            add(book, group_id, env=env)
            run(book, f"{group_id}0", rank, 2000)
        add(book, "v", env="alf")
        run(book, "v0", 1, 2100)  # headroom: rank 0 6000 (2 shop), rank 1 5900 (2 alf)
        add(book, "new", env="shop")
        return book

    no_penalty = CTBConfig(diversity_penalty_tokens=0)
    assert schedule(build(no_penalty), no_penalty) == [Admit("new0", 0)]
    assert schedule(build(CTBConfig())) == [Admit("new0", 1)]  # 6000 - 2 * 256 < 5900


def test_admission_fills_the_roomiest_ranks_and_stops_when_nothing_fits():
    book = make_book([1000, 1500])
    for i in range(6):
        add(book, f"g{i}-", hint=500)

    # Headroom minus 256 per "shop" task already there; g5 fits nowhere.
    expected = [("g0-0", 1), ("g1-0", 0), ("g2-0", 1), ("g3-0", 0), ("g4-0", 1)]
    assert schedule(book, NO_GROWTH) == [Admit(task_id, rank) for task_id, rank in expected]


def test_a_joining_rank_takes_its_share_of_a_burst_by_expected_footprint():
    book = make_book([100_000], CTBConfig(diversity_penalty_tokens=0))
    assert book.expected_footprint == 512  # the default, before any task finished
    for i in range(12):
        add(book, f"old{i}-")
        run(book, f"old{i}-0", 0, 4000)
    book.finish_task("old10-0")
    book.finish_task("old11-0")
    assert book.expected_footprint == 4000  # rank 0: 10 tasks, 40,000 tokens
    book.add_rank(1, 100_000)
    for i in range(20):
        add(book, f"new{i}-", hint=500)
    # Expected headroom: rank 0 100,000 - 10 x 4,000; rank 1 100,000 - n x 4,000 once it holds
    # n young tasks. Rank 1 takes 10 to level them, then they alternate (ties: rank 0). By
    # usage alone rank 1 would take all 20 (100,000 - 20 x 500 > 60,000).
    ranks = [d.rank for d in schedule(book, CTBConfig(diversity_penalty_tokens=0))]
    assert ranks == [1] * 10 + [0, 1] * 5


# --------------------------------------------------------------------------- growth projection


def test_projected_peak_of_tasks_of_one_age_and_of_tasks_spread_over_their_lives():
    assert projected_peak([], 300) == 0
    assert projected_peak([100, 100, 100], 300) == 900  # together: 3 x 300 as they end
    # spread: now 450; as 250 ends 2 x 300 + 0 -> (100, 200, 300) = 600; then fewer
    assert projected_peak([50, 150, 250], 300) == 600
    assert projected_peak([50, 150, 250], 250) == 450  # the oldest ends now: the usage is it
    assert projected_peak([400, 500], 300) == 900  # past the final footprint: counted now only
    assert projected_peak([60, 400], 300) == 460


def _grown_book(budget: int, final: int) -> TaskBook:
    """A rank whose finished tasks ended at ``final`` tokens, and a group g of 8 probed at 60."""
    book = make_book([budget])
    add(book, "done")
    run(book, "done0", 0, final)
    book.finish_task("done0")
    assert book.expected_footprint == final
    add(book, "g", size=8)
    run(book, "g0", 0, 60)
    return book


def test_admission_counts_each_task_at_the_footprint_it_grows_to():
    # By headroom alone the probe's 7 siblings fit (8 x 60 = 480 <= 1000), and a turn or two
    # later the rank is over its budget and pauses. Projected, 3 tasks of one age grow to 900.
    assert schedule(_grown_book(1000, 300), NO_GROWTH) == [Admit(f"g{i}", 0) for i in range(1, 8)]
    book = _grown_book(1000, 300)
    plan = schedule(book)
    assert plan == [Admit("g1", 0), Admit("g2", 0)]
    book.apply(plan)
    # the three grew apart (240, 180, 120): a new task at 60 peaks with them at 840, a second
    # at 960, a third at 1020 > 1000
    for task_id, footprint in [("g0", 240), ("g1", 180), ("g2", 120)]:
        book.report_turn(task_id, footprint, footprint)
    assert book.ranks[0].footprints == [120, 180, 240]
    assert schedule(book) == [Admit("g3", 0), Admit("g4", 0)]
    assert schedule(book, NO_GROWTH) == [Admit(f"g{i}", 0) for i in range(3, 8)]


def test_a_paused_task_resumes_only_where_its_growth_fits():
    book = _grown_book(850, 300)
    for i in (1, 2):
        book.apply([Admit(f"g{i}", 0)])
    for i in range(3, 8):
        book.drop_task(f"g{i}")
    book.report_turn("g2", 200, 200)
    book.apply([Pause("g2")])
    add(book, "h")
    run(book, "h0", 0, 150)
    # rank 0 holds 60, 60, 150 (usage 270, peak 120 + 2 x 240 = 720 <= 850); with g2 at 200
    # the peak is 470 + 4 x 100 = 870 > 850, though 470 is well within the budget
    assert (book.ranks[0].usage, projected_peak(book.ranks[0].footprints, 300)) == (270, 720)
    assert projected_peak([60, 60, 150, 200], 300) == 870
    assert schedule(book) == []
    assert schedule(book, NO_GROWTH) == [Resume("g2", 0)]


# --------------------------------------------------------------------------- the baseline


def test_request_level_baseline_is_round_robin_with_fixed_concurrency():
    config = CTBConfig(policy="request", request_concurrency=2)
    policy = make_policy(config)
    assert isinstance(policy, RequestLevelPolicy)
    assert (policy.pins_tasks, CTBPolicy.pins_tasks) == (False, True)
    book = make_book([0, 0], config)  # budgets are ignored
    add(book, "g", size=5)  # and so is probing

    plan = policy.schedule(book)
    assert plan == [Admit("g0", 0), Admit("g1", 1), Admit("g2", 0), Admit("g3", 1)]
    book.apply(plan)
    book.report_turn("g1", 50_000, 10)  # far over budget: never paused
    assert policy.schedule(book) == []
    book.finish_task("g1")
    assert policy.schedule(book) == [Admit("g4", 1)]


def test_request_level_baseline_continues_round_robin_and_resumes_orphans():
    config = CTBConfig(policy="request", request_concurrency=2)
    policy = make_policy(config)
    book = make_book([0, 0, 0], config)
    add(book, "g", size=2)
    book.apply(policy.schedule(book))  # g0 -> 0, g1 -> 1
    book.remove_rank(0)
    add(book, "h", size=2)

    assert policy.schedule(book) == [Resume("g0", 2), Admit("h0", 1), Admit("h1", 2)]


# --------------------------------------------------------------------------- book and priority


def test_priority_follows_table_1():
    book = make_book([10_000])
    add(book, "g", size=4)
    run(book, "g0", 0, 100)
    book.finish_task("g0")
    run(book, "g1", 0, 100, context=4096, running=True)
    task = book.task("g1")
    group = book.group_of(task)
    weights = PriorityWeights()

    assert priority(task, group, weights, 8192) == 256 * 0.25 + 2 + 0.5
    assert book.priority(task) == 256 * 0.25 + 2 + 0.5
    book.set_running("g1", False)
    book.finish_task("g1")
    run(book, "g2", 0, 100, context=100_000)
    assert book.priority(book.task("g2")) == 256 * 0.5 + 1.0  # L_context saturates at 1


def test_finished_and_dropped_tasks_leave_the_book_with_their_group():
    book = make_book([10_000])
    add(book, "g", size=2)
    run(book, "g0", 0, 100)
    book.finish_task("g0")
    assert book.group_of(book.task("g1")).completion == 0.5
    book.drop_task("g1")
    assert (book.tasks, book.groups, book.pending_groups, book.num_new) == ({}, {}, {}, 0)
    assert book.ranks[0].usage == 0


def test_book_rejects_impossible_events():
    book = make_book([1000])
    add(book, "g", size=2)
    with pytest.raises(ValueError, match="before it was admitted"):
        book.report_turn("g0", 10, 10)
    with pytest.raises(ValueError, match="cannot pause"):
        book.apply([Pause("g0")])
    with pytest.raises(ValueError, match="already exists"):
        add(book, "g")
    with pytest.raises(KeyError, match="rank 7"):
        book.apply([Admit("g0", 7)])
    with pytest.raises(KeyError, match="unknown task"):
        book.finish_task("nope")


def test_the_policy_does_not_mutate_the_book():
    book = _affinity_book()
    add(book, "n", size=3)
    book.report_turn("g0", 2000, 10)
    before = repr(book)

    schedule(book)
    assert repr(book) == before


# --------------------------------------------------------------------------- config


def test_default_weights_keep_the_tiers_strict():
    assert PriorityWeights().tiers_are_strict(64)
    assert not PriorityWeights().tiers_are_strict(128)
    assert not PriorityWeights(active=1.0).tiers_are_strict(2)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"weights": 3}, "weights"),
        ({"context_norm_tokens": 0}, "context_norm_tokens"),
        ({"budget_fraction": 0.0}, "budget_fraction"),
        ({"budget_fraction": 1.5}, "budget_fraction"),
        ({"default_footprint_tokens": 0}, "default_footprint_tokens"),
        ({"max_env_sessions": -1}, "max_env_sessions"),
        ({"diversity_penalty_tokens": 2.5}, "diversity_penalty_tokens"),
        ({"policy": "fifo"}, "policy"),
        ({"request_concurrency": 0}, "request_concurrency"),
    ],
)
def test_config_errors_name_the_field(kwargs, key):
    with pytest.raises(ConfigError) as error:
        CTBConfig(**kwargs)
    assert error.value.key == key


def test_config_helpers():
    with pytest.raises(ConfigError) as error:
        PriorityWeights(group_completion=-1.0)
    assert error.value.key == "group_completion"
    config = CTBConfig(weights=PriorityWeights(eval=1000.0), budget_fraction=0.5,
                       default_footprint_tokens=64)
    assert config.weights == PriorityWeights(eval=1000.0)
    assert config.rank_budget(10_001) == 5000
    book = config.new_book(max_staleness=2, tasks_per_step=8)
    assert (book.weights, book.footprints.default_tokens) == (config.weights, 64)
    assert book.train_admission_limit == 24
    assert isinstance(make_policy(CTBConfig()), CTBPolicy)


def test_a_paused_task_never_counts_as_running():
    book = make_book([1000])
    add(book, "a")
    run(book, "a0", 0, 100, context=100, running=True)
    book.apply([Pause("a0")])
    book.report_turn("a0", 200, 200)  # e.g. its observation came back while paused
    book.set_running("a0", True)

    assert book.task("a0").is_running is False
    assert book.priority(book.task("a0")) == 200 / 8192
