"""A simulated scenario -> experiment results (what `tiderl sim` runs; a profile becomes a
scenario in :func:`tiderl.profile.scenario.scenario_of`)."""

from __future__ import annotations

from functools import partial
from statistics import median
from typing import Any

from tiderl.core.system import SystemSpec
from tiderl.sim.cluster import simulate
from tiderl.sim.experiments import (
    FIG8_RATIOS,
    ExperimentResult,
    bounded,
    fixed_split,
    run_experiment,
    window_means,
)
from tiderl.sim.progress import Progress, run_all
from tiderl.sim.scenario import SimScenario
from tiderl.sim.sweep import SweepGrid, run_sweep

COMPARE_PAPER = {**FIG8_RATIOS, "note": "Fig. 8, Qwen2.5-7B on 32 H100s, WebShop + ALFWorld "
                                        "(sim/cluster32); another scenario may differ"}


def compare_policies(scenario: SimScenario, policies: list[str],
                     progress: Progress | None = None) -> ExperimentResult:
    """Each policy on the same scenario and task stream, and async at each of the scenario's
    ``sim.fixed_splits`` ("async 0.375"; the async run itself where a split is its own);
    goodput ratios against tiderl, each system's fraction of the scenario's goodput bound
    (:mod:`tiderl.sim.bound`), and tiderl against the fixed splits (:func:`against_splits`)."""
    specs = [SystemSpec.named(name) for name in policies]
    runs = {spec.label: partial(simulate, spec, scenario) for spec in specs}
    splits = {f"async {r}": r for r in scenario.sim.fixed_splits}
    own = scenario.sim.rollout_ratio
    runs |= {label: partial(fixed_split, scenario, r) for label, r in splits.items()
             if not ("async" in runs and r == own)}
    done = run_all(runs, progress)
    results = {label: done[label] for label in runs if label not in splits}
    results |= {label: done[label] if label in done else done["async"] for label in splits}
    headline: dict[str, Any] = {
        "goodput_tok_s": {k: round(v.goodput_tok_s, 1) for k, v in results.items()}}
    if "tiderl" in results:
        base = results["tiderl"].goodput_tok_s
        for name, res in results.items():
            if name != "tiderl" and res.goodput_tok_s and name not in splits:
                headline[f"tiderl_over_{name}"] = round(base / res.goodput_tok_s, 3)
        if splits:
            fixed = {r: results[label].goodput_tok_s for label, r in splits.items()}
            headline |= against_splits(base, fixed)
    device_s = bounded(headline, scenario, results)
    rows = [{"run": name, "goodput_tok_s": round(r.goodput_tok_s, 1),
             "of_bound": headline["of_bound"][name], "wall_s": round(r.wall_s, 1),
             "trained_tokens": r.trained_tokens, "generated_tokens": r.generated_tokens,
             "discarded_tokens": r.discarded_tokens,
             "kv_hit_rate": round(r.kv_hit_rate, 4), "rwt_s": round(r.rwt_s, 1),
             "twt_s": round(r.twt_s, 1)} for name, r in results.items()]
    series = {"trained_tokens": {name: [float(s.trained_tokens) for s in r.steps]
                                 for name, r in results.items()}}
    paper = COMPARE_PAPER if "tiderl" in results else {}
    return ExperimentResult("compare", headline, paper, rows, series, device_s,
                            window_means(results))


def against_splits(tiderl_tok_s: float, fixed: dict[float, float]) -> dict[str, Any]:
    """TideRL's goodput against fixed splits' (split -> goodput): the best split, TideRL over
    the best and over the median (a user who did not sweep), and its rank among them (1:
    ahead of every split)."""
    best = max(fixed, key=fixed.__getitem__)
    return {"best_fixed_split": best,
            "tiderl_over_best_fixed": round(tiderl_tok_s / fixed[best], 3),
            "tiderl_over_median_fixed": round(tiderl_tok_s / median(fixed.values()), 3),
            "tiderl_rank": 1 + sum(1 for v in fixed.values() if v > tiderl_tok_s)}


def run_scenario(scenario: SimScenario, experiment: str | None = None,
                 policies: list[str] | None = None,
                 progress: Progress | None = None) -> ExperimentResult:
    """The scenario's experiment, or its (or ``policies``') systems compared; ``progress``
    hears of each simulation as it starts (:mod:`tiderl.sim.progress`)."""
    name = experiment if experiment is not None or policies else scenario.sim.experiment
    if name:
        return run_experiment(name, scenario, progress)
    return compare_policies(scenario, policies or scenario.sim.policies, progress)


SWEEP_PAPER = {**FIG8_RATIOS, "note": "Fig. 8 (7B, 100 steps); the sweep's runs are shorter"}


def run_scenario_sweep(scenario: SimScenario, grid: SweepGrid | None = None,
                       progress: Progress | None = None) -> dict[str, Any]:
    """The sweep around the scenario: rows, the centre's ratios and each ratio's range over
    the grid; ``result`` is the :class:`~tiderl.sim.sweep.SweepResult` itself."""
    grid = grid or SweepGrid()
    result = run_sweep(scenario, grid, progress)
    keys = ("tiderl_over_sync", "tiderl_over_async", "tiderl_over_stream", "async_over_sync")
    centre = next((r for r in result.rows
                   if all(r[k] == v for k, v in result.centre.items())), None)
    headline: dict[str, Any] = {"steps": grid.steps, "centre": result.centre}
    for key in keys:
        values = [r[key] for r in result.rows if r[key] is not None]
        headline[key] = {"centre": centre[key] if centre else None,
                         "min": min(values, default=None), "max": max(values, default=None)}
    return {"experiment": "sweep", "headline": headline, "paper": SWEEP_PAPER,
            "rows": result.rows, "result": result}
