"""`tiderl top`'s view without a terminal: snapshots folded into a TopState, rendered at an
injected ``now`` into a recording console."""

from __future__ import annotations

import re

from rich.console import Console

from tiderl.cli.top_view import (
    HISTORY_LEN,
    SPARK_CHARS,
    STALE_S,
    TopState,
    render,
    sparkline,
    usage_bar,
)
from tiderl.runtime.bus import RankMetrics, Snapshot


def snapshot(step: int, record_step: int | None = None, **metrics: float) -> Snapshot:
    values = {"steps": 200.0, "elapsed_s": 12.5, "active": 6.0, "paused": 2.0, "new": 3.0,
              **metrics}
    if record_step is not None:
        values["step"] = float(record_step)
    return Snapshot(
        step=step, time=12.5, roles={0: "rollout", 1: "rollout", 2: "actor", 3: "ref"},
        metrics=values, step_mode="decoupled", ctb_budgets={0: 1843, 1: 3686}, ranks=[
            RankMetrics(rank=0, role="rollout", kv_tokens_used=1536, kv_tokens_capacity=2048,
                        prefix_hit_rate=0.625, running=5, waiting=1, prefix_queries=800,
                        prefix_hits=500),
            RankMetrics(rank=1, role="rollout", kv_tokens_used=100, kv_tokens_capacity=4096,
                        prefix_hit_rate=0.5, running=2, waiting=0, prefix_queries=200,
                        prefix_hits=100),
            RankMetrics(rank=2, role="actor", kv_tokens_used=0, kv_tokens_capacity=0,
                        prefix_hit_rate=0.0, running=0, waiting=0),
        ])


def text(state: TopState, now: float) -> str:
    console = Console(record=True, width=160)
    console.print(render(state, now))
    return console.export_text()


def row(out: str, rank: int) -> list[str]:
    """The words of the ranks-table row of ``rank`` (an empty cell has none)."""
    for line in out.splitlines():
        words = line.split()
        if len(words) > 1 and words[0] == str(rank) and words[1] in ("rollout", "actor", "ref"):
            return words
    raise AssertionError(f"no row for rank {rank} in:\n{out}")


def test_sparkline_scales_between_min_and_max():
    assert sparkline([]) == ""
    assert sparkline([0, 7, 3.5]) == "▁█▅"
    assert sparkline(range(8)) == SPARK_CHARS
    assert sparkline([2.0, 2.0, 2.0]) == "▄▄▄"
    assert sparkline([1.0, float("nan"), 2.0]) == "▁█"
    assert len(sparkline(range(100))) == HISTORY_LEN


def test_usage_bar():
    assert usage_bar(1536, 2048) == "█████████░░░"
    assert usage_bar(1536, 2048, width=8) == "██████░░"
    assert usage_bar(5000, 2048, width=4) == "████"
    assert usage_bar(0, 0) == ""


def test_render_shows_the_ranks_with_roles_kv_capacity_budgets_and_gauges():
    state = TopState(job="job-1", endpoint="tcp://127.0.0.1:5555", started_at=0.0)
    state.fold(snapshot(7, record_step=6, goodput_tok_s=1234.5, reward_mean=0.25, ras=3.0,
                        tprm_s=0.125, rwt_s=1.5, twt_s=0.25, kv_hit_rate=0.5,
                        staleness_max=2.0), now=10.0)
    out = text(state, now=10.4)
    assert "tiderl top · job-1" in out and "tcp://127.0.0.1:5555" in out
    assert "connected (last update 0.4 s ago)" in out and "disconnected" not in out
    assert "step       7/200" in out and "elapsed 12.5 s" in out
    assert "2 rollout" in out and "1 actor" in out and "1 ref" in out
    assert "step mode decoupled" in out
    assert "1234.5 tok/s" in out and "reward     0.250" in out and "staleness 2" in out
    assert "RAS 3   TPRM 0.125 s   RWT 1.50 s   TWT 0.25 s" in out
    assert "active 6   paused 2   new 3" in out
    assert "KV hit rate 50.0% (last step), 60.0% (all)" in out
    assert row(out, 0) == ["0", "rollout", "1536/2048", "(75%)", "█████████░░░", "1843",
                           "62.5%", "5", "1"]
    assert row(out, 1)[:6] == ["1", "rollout", "100/4096", "(2%)", "░░░░░░░░░░░░", "3686"]
    assert row(out, 2) == ["2", "actor", "—", "—", "—", "0", "0"]  # no KV, no CTB budget
    assert row(out, 3) == ["3", "ref", "—", "—", "—", "—", "—"]  # no gauges from it yet


def test_the_ranks_table_fits_80_columns_with_a_full_bar():
    state = TopState(job="j", endpoint="e", started_at=0.0)
    snap = snapshot(1)
    full = RankMetrics(rank=0, role="rollout", kv_tokens_used=32768, kv_tokens_capacity=32768,
                       prefix_hit_rate=0.5, running=128, waiting=64, prefix_queries=10)
    state.fold(Snapshot(step=1, time=1.0, roles=snap.roles, metrics=snap.metrics,
                        ranks=[full], ctb_budgets={0: 29491}), now=1.0)
    console = Console(record=True, width=80)
    console.print(render(state, now=1.0))
    assert ["0", "rollout", "32768/32768", "(100%)", "█" * 12, "29491", "50.0%", "128",
            "64"] in [line.split() for line in console.export_text().splitlines()]


def test_the_snapshot_roles_win_over_a_rank_gauge_that_lags():
    snap = snapshot(1)
    snap = Snapshot(step=1, time=1.0, roles={**snap.roles, 1: "actor"}, metrics=snap.metrics,
                    ranks=snap.ranks)
    state = TopState(job="j", endpoint="e", started_at=0.0)
    state.fold(snap, now=1.0)
    assert row(text(state, now=1.0), 1)[1] == "actor"


def test_history_gets_one_point_per_step_record():
    state = TopState(job="j", endpoint="e", started_at=0.0)
    state.fold(snapshot(1), now=0.5)  # no step record yet
    for i, (record_step, goodput) in enumerate([(0, 10.0), (0, 10.0), (1, 30.0), (1, 30.0),
                                                (2, 20.0)]):
        state.fold(snapshot(record_step + 1, record_step, goodput_tok_s=goodput, ras=1.0),
                   now=1.0 + i)
    assert list(state.history["goodput_tok_s"]) == [10.0, 30.0, 20.0]
    assert list(state.history["ras"]) == [1.0, 1.0, 1.0]
    assert list(state.history["tprm_s"]) == []  # absent from every record
    out = text(state, now=6.0)
    assert "goodput  ▁█▅" in out and "20.0 tok/s  10 … 30" in out
    assert re.search(r"TPRM +— +—", out)


def test_history_keeps_the_last_steps():
    state = TopState(job="j", endpoint="e", started_at=0.0)
    for step in range(HISTORY_LEN + 10):
        state.fold(snapshot(step + 1, step, reward_mean=float(step)), now=float(step))
    assert list(state.history["reward_mean"]) == [float(s) for s in range(10, HISTORY_LEN + 10)]


def test_a_silent_bus_shows_disconnected_and_a_new_snapshot_connected():
    state = TopState(job="j", endpoint="e", started_at=0.0)
    state.fold(snapshot(3, 2, reward_mean=0.5), now=100.0)
    assert "connected (last update 2.5 s ago)" in text(state, now=102.5)
    out = text(state, now=100.0 + STALE_S + 4.2)
    assert "disconnected (no snapshot for 7 s) — reconnecting" in out
    assert "reward     0.500" in out  # the last view stays
    state.fold(snapshot(4, 3), now=110.0)
    out = text(state, now=110.1)
    assert "connected (last update 0.1 s ago)" in out and "disconnected" not in out


def test_before_the_first_snapshot_it_waits_then_says_disconnected():
    state = TopState(job="j", endpoint="e", started_at=50.0)
    out = text(state, now=51.0)
    assert "waiting for the first snapshot (1.0 s)" in out and "ranks" not in out
    assert "disconnected (no snapshot for 5 s)" in text(state, now=55.0)


def test_a_note_is_shown_only_when_there_is_one():
    state = TopState(job="j", endpoint="e", started_at=0.0)
    state.fold(snapshot(1), now=1.0)
    assert "note" not in text(state, now=1.0)
    snap = snapshot(2)
    state.fold(Snapshot(step=2, time=2.0, roles=snap.roles, metrics=snap.metrics,
                        ranks=snap.ranks, note="pending: 2 rollout / 2 trainer"), now=2.0)
    assert "note       pending: 2 rollout / 2 trainer" in text(state, now=2.0)


def test_an_ended_job_keeps_its_last_view():
    state = TopState(job="j", endpoint="e", started_at=0.0)
    state.fold(snapshot(5, 4, reward_mean=0.75), now=1.0)
    state.is_job_ended = True
    out = text(state, now=30.0)
    assert "job ended (last snapshot 29.0 s ago); q quits" in out
    assert "disconnected" not in out and "reward     0.750" in out


def test_missing_metrics_show_a_dash():
    state = TopState(job="j", endpoint="e", started_at=0.0)
    state.fold(Snapshot(step=0, time=0.0, roles={}, metrics={}, ranks=[]), now=0.0)
    out = text(state, now=0.0)
    assert "step       0/—" in out and "RAS —   TPRM —" in out and "step mode —" in out
