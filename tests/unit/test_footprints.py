"""CTB's footprint estimates (tiderl.core.footprints): F before and after the first finish, and
the admissions the growth bound changes, on hand-built books with exact decisions."""

from __future__ import annotations

from tiderl.core.ctb import CTBConfig, CTBPolicy, TaskBook
from tiderl.core.footprints import FOOTPRINT_WINDOW, FootprintModel, MovingMean
from tiderl.core.types import Admit, Group, Task


def test_moving_mean_is_exact_until_its_window_then_weighs_the_recent():
    mean = MovingMean()
    for x in (10, 20, 60):
        mean.add(x)
    assert (mean.value, mean.count) == (30, 3)
    mean = MovingMean(value=100.0, count=FOOTPRINT_WINDOW)
    mean.add(100 + FOOTPRINT_WINDOW)
    assert mean.value == 101


def test_growth_bound_is_first_turn_plus_growth_up_to_the_turn_limit():
    model = FootprintModel(default_tokens=512)
    model.task_added("guess", 8)
    assert model.expected() == 512 and model.growth_bound() is None  # nothing measured
    model.probe_reported("guess", 44)
    assert model.growth_bound() is None  # no growth yet
    for last, now in [(44, 64), (64, 94)]:
        model.turn_reported("guess", last, now)  # +20, +30: 25 a turn
    assert model.growth_bound() == 44 + 7 * 25 == 219
    assert model.expected() == 219

    # another environment seen and unmeasured: no bound, the default
    model.task_added("shop", 8)
    assert model.expected() == 512
    model.probe_reported("shop", 70)
    model.turn_reported("shop", 70, 100)
    assert model.growth_bound() == 70 + 7 * 30 == 280  # the larger of 219 and 280

    # a task whose turn limit is not known: no bound
    model.task_added("shop", None)
    assert (model.growth_bound(), model.expected()) == (None, 512)


def test_growth_bound_only_tightens_the_default_and_gives_way_to_finishes():
    model = FootprintModel(default_tokens=512)
    model.task_added("shop", 8)
    model.probe_reported("shop", 400)
    model.turn_reported("shop", 400, 500)
    assert (model.growth_bound(), model.expected()) == (400 + 7 * 100, 512)  # 1,100: the default

    model = FootprintModel(default_tokens=512)
    model.task_added("guess", 4)
    model.probe_reported("guess", 100)
    model.turn_reported("guess", 100, 150)
    assert model.expected() == 250
    model.bounds_growth = False  # ctb.growth_bound=false
    assert model.expected() == 512
    model.bounds_growth = True
    model.task_finished(230)
    assert (model.num_finished, model.expected()) == (1, 230)  # F measured


def _group(book: TaskBook, group_id: str, size: int, env: str, max_turns: int | None) -> None:
    book.add_group(Group(group_id, tuple(Task(f"{group_id}{i}", group_id, env, max_turns=max_turns)
                                         for i in range(size))))


def _probed_book(max_turns: int | None) -> TaskBook:
    """A rank of 2,000 tokens and a group g of 8 guess tasks whose probe's first turn is 100."""
    book = CTBConfig().new_book()
    book.add_rank(0, 2000)
    _group(book, "g", 8, "guess", max_turns)
    book.apply([Admit("g0", 0)])
    book.report_turn("g0", 100, 90)
    return book


def test_the_growth_bound_admits_by_what_tasks_grow_to_before_any_finished():
    # Before the probe's second turn F is the default 512: 3 x 512 = 1,536 <= 2,000 < 4 x 512,
    # so the probe's 7 siblings at 100 go 2 at once.
    book = _probed_book(max_turns=4)
    assert CTBPolicy(CTBConfig()).schedule(book) == [Admit("g1", 0), Admit("g2", 0)]
    # Its second turn grows 50 tokens: F <= 100 + 3 x 50 = 250. The rank's peak with all 7 at
    # 100 beside the probe at 150 is 7 x 250 = 1,750 (as the seven reach 250, the probe has
    # ended): all go.
    book.report_turn("g0", 150, 140)
    assert book.expected_footprint == 250
    assert book.footprints.growth["guess"].count == 1
    assert CTBPolicy(CTBConfig()).schedule(book) == [Admit(f"g{i}", 0) for i in range(1, 8)]
    book.apply([Admit("g1", 0)])
    book.report_turn("g1", 100, 90)
    book.finish_task("g0")  # F is measured (150): growth is no longer sampled
    book.report_turn("g1", 400, 390)
    assert (book.footprints.growth["guess"].count, book.expected_footprint) == (1, 150)

    # the turn limit not known: F stays 512, and three siblings fit beside the probe at 150
    # (peak 450 + 4 x 362 = 1,898; a fourth: 550 + 5 x 362 = 2,360 > 2,000)
    book = _probed_book(max_turns=None)
    book.report_turn("g0", 150, 140)
    assert book.expected_footprint == 512
    assert CTBPolicy(CTBConfig()).schedule(book) == [Admit(f"g{i}", 0) for i in range(1, 4)]


def test_a_measured_growth_bound_lets_an_unprobed_group_skip_its_probe():
    # g's probe g0 reported its first turn (100): F is still the default 512, so the new group h
    # (4 guess tasks, admitted at guess's mean first turn, 100) offers its probe alone.
    book = CTBConfig().new_book()
    book.add_rank(0, 2000)
    _group(book, "g", 2, "guess", 4)
    book.apply([Admit("g0", 0)])
    book.report_turn("g0", 100, 90)
    _group(book, "h", 4, "guess", 4)
    assert not book.is_footprint_measured
    assert CTBPolicy(CTBConfig()).schedule(book) == [Admit("g1", 0), Admit("h0", 0)]
    # g0's second turn grows 50 tokens: F is the growth bound 100 + 3 x 50 = 250, measured
    # before any task finished. The rank holds h grown to it (2,000 - 250 >= 4 x 250), so h's
    # probe would protect nothing: all four go, each placed by the projected peak (6 x 250).
    book.report_turn("g0", 150, 140)
    assert book.is_footprint_measured and book.num_finished == 0
    assert CTBPolicy(CTBConfig()).schedule(book) == [
        Admit("g1", 0), *(Admit(f"h{i}", 0) for i in range(4))]
    # without the bound F is the default, not measured: h probes
    book.footprints.bounds_growth = False
    assert not book.is_footprint_measured
    assert CTBPolicy(CTBConfig(growth_bound=False)).schedule(book) == [
        Admit("g1", 0), Admit("h0", 0)]


def test_a_growth_bound_above_the_default_is_not_a_measured_f():
    model = FootprintModel(default_tokens=512)
    model.task_added("shop", 8)
    assert not model.is_measured()
    model.probe_reported("shop", 400)
    model.turn_reported("shop", 400, 500)  # bound 1,100 > 512: F is the default
    assert not model.is_measured()
    model.task_finished(900)
    assert model.is_measured()
