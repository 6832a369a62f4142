import pytest

from tiderl.core.readiness import (
    ReadinessTracker,
    hol_latency,
    mean_post_start_gap,
    num_ready_at_start,
    post_start_gaps,
    readiness_signals,
    relative_ready_times,
)
from tiderl.core.types import ReadinessSignals

# Step starts at t=100. Ready at 90, 95, 100 (3 at the start, 100 counts: a_i = 0 <= 0),
# then 101, 104, 110: the first post-start arrival opens no gap, gaps are 3 and 6.
TIMES = [104.0, 90.0, 110.0, 100.0, 95.0, 101.0]


def test_relative_times_are_sorted_and_shifted():
    assert relative_ready_times(TIMES, 100.0) == [-10.0, -5.0, 0.0, 1.0, 4.0, 10.0]


def test_ras_counts_ready_at_or_before_start():
    assert num_ready_at_start(TIMES, 100.0) == 3
    assert num_ready_at_start([], 100.0) == 0


def test_post_start_gaps_skip_the_first_arrival():
    assert post_start_gaps(TIMES, 100.0) == [3.0, 6.0]
    assert mean_post_start_gap(TIMES, 100.0) == 4.5


def test_tprm_is_none_without_two_post_start_arrivals():
    assert mean_post_start_gap([90.0, 101.0], 100.0) is None
    assert mean_post_start_gap([90.0, 95.0], 100.0) is None


def test_hol_latency():
    assert hol_latency([95.0, 90.0], now=112.0) == 22.0
    assert hol_latency([], now=112.0) == 0.0


def test_signals_from_one_list():
    signals = readiness_signals(TIMES, 100.0, now=112.0, samples_per_mb=8, tokens_per_mb=1000)
    assert signals == ReadinessSignals(
        ras=3, tprm_s=4.5, hol_latency_s=22.0, ready_volume=48, ready_tokens=6000
    )


def test_signals_ignore_times_after_now():
    signals = readiness_signals(TIMES, 100.0, now=105.0)
    assert signals == ReadinessSignals(
        ras=3, tprm_s=3.0, hol_latency_s=15.0, ready_volume=5, ready_tokens=0
    )


def test_empty_buffer():
    assert readiness_signals([], 0.0, now=5.0) == ReadinessSignals(0, None, 0.0, 0, 0)


def _tracker_with_one_step() -> ReadinessTracker:
    tracker = ReadinessTracker(step_start=0.0)
    tracker.record_ready("a", 1.0, num_samples=4, num_tokens=400)
    tracker.record_ready("b", 3.0, num_samples=4, num_tokens=300)
    tracker.record_consumed("a")
    tracker.start_step(10.0)  # "b" is buffered at the start: RAS 1
    tracker.record_ready("c", 12.0, num_samples=2, num_tokens=100)
    tracker.record_ready("d", 13.0, num_samples=2, num_tokens=100)
    tracker.record_ready("e", 17.0, num_samples=2, num_tokens=100)
    tracker.record_consumed("b")
    tracker.record_consumed("c")
    return tracker


def test_tracker_step_view():
    tracker = _tracker_with_one_step()
    assert tracker.step_ras == 1
    assert tracker.step_ready_times() == [-7.0, 2.0, 3.0, 7.0]
    assert tracker.num_buffered == 2


def test_tracker_boundary_signals():
    tracker = _tracker_with_one_step()
    # buffered now: d (13) and e (17); TPRM from arrivals 12, 13, 17: gaps 1 and 4.
    assert tracker.signals(now=20.0) == ReadinessSignals(
        ras=2, tprm_s=2.5, hol_latency_s=7.0, ready_volume=4, ready_tokens=200
    )


def test_tracker_next_step_starts_fresh():
    tracker = _tracker_with_one_step()
    tracker.start_step(20.0)
    assert tracker.step_ras == 2
    assert tracker.signals(now=20.0).tprm_s is None
    tracker.record_ready("f", 21.0)
    tracker.record_ready("g", 23.0)
    assert tracker.signals(now=23.0).tprm_s == 2.0
    assert tracker.step_ready_times() == [-7.0, -3.0, 1.0, 3.0]


def test_tracker_refuses_bad_events():
    tracker = ReadinessTracker()
    tracker.record_ready("a", 1.0)
    with pytest.raises(ValueError, match="already"):
        tracker.record_ready("a", 2.0)
    with pytest.raises(KeyError):
        tracker.record_consumed("zzz")
    with pytest.raises(ValueError, match="negative"):
        tracker.record_ready("b", 1.0, num_samples=-1)
