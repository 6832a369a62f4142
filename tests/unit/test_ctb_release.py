"""CTB's release phase: tasks waiting for their environment longer than recomputing their context
takes are paused (unpinned) while work waits for room; exact scenarios on hand-built books."""

from __future__ import annotations

import pytest

from tiderl.core.ctb import CTBConfig, CTBPolicy, TaskBook
from tiderl.core.env_waits import WAIT_WINDOW, WaitSamples
from tiderl.core.step_control import RolloutControl
from tiderl.core.types import Admit, Group, Pause, Resume, Task

# fit by headroom alone (footprints below are exact), releasing
CONFIG = CTBConfig(project_growth=False, release_waiting=True)


def book_with(budgets: list[int], rate: float | None = 1000.0, **window: int) -> TaskBook:
    book = CONFIG.new_book(**window)
    for rank, budget in enumerate(budgets):
        book.add_rank(rank, budget)
        if rate is not None:
            book.set_prefill_rate(rank, rate)
    return book


def add(book: TaskBook, group_id: str, size: int = 1, env: str = "shop",
        hint: int | None = None) -> list[str]:
    tasks = tuple(Task(f"{group_id}{i}", group_id, env, footprint_hint=hint) for i in range(size))
    book.add_group(Group(group_id, tasks))
    return [t.task_id for t in tasks]


def waiting(book: TaskBook, task_id: str, rank: int, footprint: int, context: int,
            since: float) -> None:
    """Admit a task and report a turn after which its environment works (from ``since``)."""
    book.apply([Admit(task_id, rank)])
    book.report_turn(task_id, footprint, context, is_running=False)
    book.wait_started(task_id, since)


def measured(book: TaskBook, env: str, *waits: float) -> None:
    """``env``'s environment answered after these waits (other tasks, now gone)."""
    for k, wait in enumerate(waits):
        group = f"past-{env}-{k}"
        add(book, group, env=env)
        book.apply([Admit(f"{group}0", 0)])
        book.report_turn(f"{group}0", 1, 1, is_running=False)
        book.wait_started(f"{group}0", 0.0)
        book.wait_ended(f"{group}0", wait)
        book.finish_task(f"{group}0")


def schedule(book: TaskBook, config: CTBConfig = CONFIG) -> list:
    plan = CTBPolicy(config).schedule(book)
    book.apply(plan)
    return plan


# --------------------------------------------------------------------------- wait estimates


def test_remaining_wait_is_the_mean_excess_over_the_waits_longer_than_the_age():
    samples = WaitSamples()
    for wait in (1.0, 2.0, 3.0, 10.0):
        samples.add(wait)
    assert samples.remaining(0.0) == 4.0  # the mean
    assert samples.remaining(2.5) == (3.0 + 10.0) / 2 - 2.5  # a long wait tends to go on
    assert samples.remaining(10.0) == 4.0  # older than every sample: the mean again


def test_wait_samples_keep_the_last_window():
    samples = WaitSamples()
    for k in range(WAIT_WINDOW + 10):
        samples.add(100.0 if k < 10 else 1.0)
    assert samples.remaining(0.0) == 1.0


def test_the_book_measures_waits_per_environment_and_ages_them_to_now():
    book = book_with([1000])
    measured(book, "shop", 2.0, 4.0)
    measured(book, "guess", 0.5)
    add(book, "a")
    waiting(book, "a0", 0, 300, 200, since=10.0)
    book.now = 10.0
    assert book.expected_wait(book.task("a0")) == 3.0
    book.now = 13.0  # waited 3 s: only the 4 s wait is longer
    assert book.expected_wait(book.task("a0")) == 1.0
    assert book.recompute_s(book.task("a0")) == 0.2  # 200 tokens at 1,000 tokens/s


def test_nothing_is_estimated_without_a_measured_wait_or_rate():
    book = book_with([1000], rate=None)
    add(book, "a")
    waiting(book, "a0", 0, 300, 200, since=0.0)
    assert book.expected_wait(book.task("a0")) is None  # no wait of "shop" measured
    assert book.recompute_s(book.task("a0")) is None
    with pytest.raises(ValueError, match="prefill rate"):
        book.set_prefill_rate(0, 0.0)


# --------------------------------------------------------------------------- the release phase


def blocked_book(rate: float | None = 1000.0, waits: tuple[float, ...] = (2.0,)) -> TaskBook:
    """A 1,000-token rank full of two tasks waiting for their environment (contexts of 300
    tokens: 0.3 s to recompute at 1,000 tokens/s) and a probed group of two waiting for room."""
    book = book_with([1000], rate=rate)
    measured(book, "shop", *waits)
    add(book, "a", size=2)
    waiting(book, "a0", 0, 400, 300, since=0.0)
    waiting(book, "a1", 0, 400, 300, since=0.0)
    add(book, "n", size=2)
    book.apply([Admit("n0", 0)])
    book.report_turn("n0", 150, 100, is_running=True)  # n is probed at 150 tokens
    return book


def test_waiting_tasks_are_released_when_a_new_group_fits_nowhere():
    book = blocked_book()
    assert book.ranks[0].headroom == 50
    assert schedule(book) == [Pause("a0", released=True), Pause("a1", released=True),
                              Admit("n1", 0)]
    assert book.ranks[0].usage == 300  # the KV of the tasks that generate


def test_no_release_while_the_waiting_work_fits():
    book = blocked_book()
    book.set_budget(0, 1200)  # n1's 150 tokens fit
    assert schedule(book) == [Admit("n1", 0)]


def test_no_release_when_the_wait_is_shorter_than_the_recompute():
    assert schedule(blocked_book(rate=100.0)) == []  # 3 s to recompute, 2 s to wait
    assert schedule(blocked_book(waits=(0.25,))) == []  # 0.3 s to recompute


def test_no_release_without_a_measured_prefill_rate():
    assert schedule(blocked_book(rate=None)) == []


def test_no_release_for_a_group_the_staleness_window_holds_back():
    book = book_with([1000], tasks_per_step=2)  # limit: (0 + 1) x 2 training tasks
    measured(book, "shop", 2.0)
    add(book, "a", size=2)
    waiting(book, "a0", 0, 400, 300, since=0.0)
    waiting(book, "a1", 0, 400, 300, since=0.0)
    add(book, "n", size=2)  # throttled: the window holds a's two tasks already
    assert book.num_admitted_train >= 2
    assert schedule(book) == []


def test_released_task_waits_for_its_environment_then_resumes_before_any_admission():
    book = blocked_book()
    schedule(book)  # a0, a1 released; n1 admitted
    book.report_turn("n1", 150, 100, is_running=True)
    add(book, "m", hint=512)
    book.now = 0.5
    assert schedule(book) == [Admit("m0", 0)]  # the released tasks hold no room as they wait
    book.report_turn("m0", 512, 400, is_running=True)
    book.wait_ended("a0", 1.0)  # a0's environment answered (a1's works on)
    book.now = 1.0
    add(book, "k", hint=512)
    book.finish_task("n0")
    assert schedule(book) == []  # a0's 400 tokens do not fit in 338, and k waits behind it
    book.finish_task("n1")
    book.finish_task("m0")
    assert schedule(book) == [Resume("a0", 0), Admit("k0", 0)]


def test_released_task_resumes_on_its_last_rank_before_its_group_rank():
    book = book_with([1000, 1000])
    measured(book, "shop", 2.0)
    add(book, "a", size=3)
    waiting(book, "a0", 0, 400, 300, since=0.0)
    book.apply([Admit("a1", 1), Admit("a2", 1)])  # most of group a runs on rank 1
    book.report_turn("a1", 100, 50, is_running=True)
    book.report_turn("a2", 100, 50, is_running=True)
    book.apply([Pause("a0", released=True)])
    book.wait_ended("a0", 1.0)
    assert schedule(book) == [Resume("a0", 0)]


def test_a_task_paused_for_the_budget_resumes_while_its_environment_works():
    book = book_with([1000])
    measured(book, "shop", 2.0)
    add(book, "a")
    waiting(book, "a0", 0, 400, 300, since=0.0)
    book.apply([Pause("a0")])  # over budget earlier, say
    assert schedule(book) == [Resume("a0", 0)]


def test_release_is_off_by_default():
    assert schedule(blocked_book(), CTBConfig(project_growth=False)) == []


# --------------------------------------------------------------------------- the step cycle


def test_rollout_control_measures_waits_from_turn_events():
    control = RolloutControl.of(CONFIG, budget=1000, max_new_tokens=100)
    control.add_rank(0, now=0.0)
    control.set_prefill_rate(0, 500.0)
    group = Group("g", (Task("g0", "g", "shop"),))
    control.add_group(group, now=0.0)
    assert control.schedule(now=0.0) == [Admit("g0", 0)]
    control.turn_done("g0", context_tokens=250, output_tokens=20, now=1.0)
    task = control.book.task("g0")
    assert task.waiting_since == 1.0 and not task.is_running
    control.turn_started("g0", now=3.5)
    assert task.waiting_since is None and task.is_running
    control.book.now = 3.5
    control.turn_done("g0", context_tokens=300, output_tokens=20, now=4.0)
    control.advance(5.0)
    assert control.book.expected_wait(task) == 1.5  # 2.5 s measured, 1 s of it waited
    assert control.book.recompute_s(task) == 0.6
