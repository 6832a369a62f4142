"""Each simulation an experiment, a comparison or a sweep runs is announced before it starts,
numbered out of a total known from the start."""

from __future__ import annotations

import pytest

from tiderl.core.job import JobShape
from tiderl.sim.config import SimConfig
from tiderl.sim.experiments import fig14, fig15
from tiderl.sim.progress import run_all, workers
from tiderl.sim.runner import compare_policies
from tiderl.sim.scenario import SimScenario
from tiderl.sim.sweep import SweepGrid, run_sweep

SMALL = SimScenario(sim=SimConfig(workload="webshop", gpus=4, rollout_ratio=0.5, seed=3),
                    job=JobShape(steps=2, group_size=4, batch_groups=4, batch_min_groups=2))


def heard() -> tuple[list[tuple[str, int, int]], object]:
    calls: list[tuple[str, int, int]] = []
    return calls, lambda label, n, total: calls.append((label, n, total))


def test_run_all_announces_each_run_before_it_starts():
    calls, progress = heard()
    order: list[str] = []

    def run(name: str) -> str:
        order.append(f"ran {name}; announced {len(calls)}")
        return name.upper()

    results = run_all({"a": lambda: run("a"), "b": lambda: run("b")}, progress)
    assert results == {"a": "A", "b": "B"}
    assert calls == [("a", 1, 2), ("b", 2, 2)]
    assert order == ["ran a; announced 1", "ran b; announced 2"]
    assert run_all({"a": lambda: 1}) == {"a": 1}  # no one listening


def test_experiments_and_comparisons_name_their_runs():
    calls, progress = heard()
    fig14(SMALL, progress)
    assert calls == [(mode, n, 4) for n, mode in
                     enumerate(("colocated", "decoupled", "vs", "vso"), start=1)]
    calls, progress = heard()
    result = fig15(SMALL, progress)
    assert calls == [("tiderl (ERS)", 1, 4), ("fixed 0.125", 2, 4), ("fixed 0.25", 3, 4),
                     ("fixed 0.5", 4, 4)]
    assert [row["run"] for row in result.rows] == [label for label, _, _ in calls]
    calls, progress = heard()
    compare_policies(SMALL, ["async", "tiderl"], progress)
    assert calls == [("async", 1, 2), ("tiderl", 2, 2)]


def test_a_comparison_runs_async_at_each_fixed_split_and_reuses_its_own():
    calls, progress = heard()
    scenario = SMALL.with_sim(fixed_splits=[0.75, 0.25, 0.5])  # 0.5 is the profile's split
    result = compare_policies(scenario, ["async", "tiderl"], progress)
    assert calls == [("async", 1, 4), ("tiderl", 2, 4), ("async 0.25", 3, 4),
                     ("async 0.75", 4, 4)]
    assert [row["run"] for row in result.rows] == ["async", "tiderl", "async 0.25", "async 0.5",
                                                   "async 0.75"]
    goodput = result.headline["goodput_tok_s"]
    assert goodput["async 0.5"] == goodput["async"]
    fixed = [goodput[f"async {r}"] for r in (0.25, 0.5, 0.75)]
    assert result.headline["tiderl_rank"] == 1 + sum(v > goodput["tiderl"] for v in fixed)
    assert result.headline["best_fixed_split"] == (0.25, 0.5, 0.75)[fixed.index(max(fixed))]
    assert "tiderl_over_async 0.25" not in result.headline  # the splits have their own ratios


def test_a_sweep_names_each_point_and_system():
    calls, progress = heard()
    grid = SweepGrid(steps=2, env_median_s=(1.0,), env_sigma=(1.0,), max_staleness=(2,),
                     colocate_switch_s=())
    result = run_sweep(SMALL, grid, progress)
    assert len(result.rows) == 2
    # the heat map's cell, then eta 2 at the centre (the scenario's own: no env override)
    assert [label for label, _, _ in calls] == [
        f"{point}: {name}" for point in ("env 1 s sigma 1, eta 1, switch 5 s",
                                         "env 0 s sigma 0, eta 2, switch 5 s")
        for name in ("sync", "async", "stream", "tiderl")]
    assert [(n, total) for _, n, total in calls] == [(n, 8) for n in range(1, 9)]


def test_runs_in_worker_processes_give_the_same_results_announced_in_order():
    """Two at a time in worker processes: each run is announced as it starts (the first two at
    once, the third when one has finished), and every result equals the one-process run's."""
    serial_calls, progress = heard()
    serial = compare_policies(SMALL.with_sim(fixed_splits=[0.25]), ["async", "tiderl"], progress)
    calls, progress = heard()
    with workers(2):
        parallel = compare_policies(SMALL.with_sim(fixed_splits=[0.25]), ["async", "tiderl"],
                                    progress)
    assert parallel.rows == serial.rows and parallel.headline == serial.headline
    assert parallel.device_s == serial.device_s and parallel.series == serial.series
    assert parallel.window_s == serial.window_s and parallel.window_s
    assert calls == serial_calls == [("async", 1, 3), ("tiderl", 2, 3), ("async 0.25", 3, 3)]


def test_workers_must_be_at_least_one():
    with pytest.raises(ValueError, match="workers must be >= 1"), workers(0):
        pass
