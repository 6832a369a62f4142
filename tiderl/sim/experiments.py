"""The paper's experiments, each a function of a scenario: simulated figures beside the paper's.

    fig4    RWT and TWT per step vs static rollout ratio (8 GPUs, WebShop)          paper Fig. 4
    fig8    training throughput per system, 7B and 14B (32 GPUs, WebShop+ALFWorld)  paper Fig. 8
    table2  ablation on OSWorld, 4B: stream, +RA2P, +ERS, +CTB                       paper Table 2
    fig12   one GPU rolls out one step: CTB vs fixed concurrency 1024 / 512         paper Fig. 12/13
    fig14   8 ready micro-batches x 8192 tokens on 4 GPUs: CM, DM, VS, VSO          paper Fig. 14
    fig15   total RWT + TWT over 100 steps: ERS vs fixed ratios (8 GPUs)            paper Fig. 15

An experiment returns an :class:`ExperimentResult`: headline numbers (``bench/results/sim.json``
keeps them, each beside ``paper``), table rows, and per-step series for plots. :data:`PAPER` is
the one copy of the paper's figures, keyed as the headline is (a figure under the same path is
the paper's for that number; strings are notes). Each experiment names its simulations before it
runs the first (:func:`tiderl.sim.progress.run_all`), so a caller can show which is running and
how many are left. Systems are named
as everywhere in TideRL (sync, async, stream, tiderl; :mod:`tiderl.core.system`): the paper's
VeRL, AReaL and StreamRL are sync, async and stream, and its figures are keyed the same way here.
Nothing here is tuned to the paper: where the simulator disagrees, the gap is reported (see
docs/simulator.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tiderl.core.quote import short
from tiderl.core.system import StepMode, System, SystemSpec
from tiderl.sim.bound import scenario_bound
from tiderl.sim.cluster import SimResult, simulate, simulate_rollout_step, simulate_trainer_step
from tiderl.sim.progress import Progress, run_all
from tiderl.sim.scenario import SYSTEMS, SimScenario

RATIOS = (0.125, 0.25, 0.5)

# Fig. 8 (§6.2): TideRL over VeRL (sync), AReaL (async) and StreamRL (stream), one figure each
FIG8_RATIOS = {"tiderl_over_sync": 5.6, "tiderl_over_async": 1.8, "tiderl_over_stream": 7.0}
PAPER: dict[str, dict[str, Any]] = {
    "fig4": {"shape": "0.125 starves the trainer (high TWT); 0.5 throttles rollout (high RWT); "
                      "0.25 is best but RWT and TWT cross from step to step"},
    "fig8": {"7b": FIG8_RATIOS,
             "14b": {k: v for k, v in FIG8_RATIOS.items() if k != "tiderl_over_stream"},
             "note": "over VeRL (sync), AReaL (async), StreamRL (stream), one figure for both "
                     "models; abstract: 1.8-7.0x on text-only tasks; StreamRL's 14B run did "
                     "not finish"},
    "table2": {"goodput_k_tok_s": {"stream": 20.2, "+RA2P": 23.1, "+ERS": 31.8, "+CTB": 33.3},
               "improvement": {"+RA2P": 0.104, "+ERS": 0.357, "+CTB": 0.048}},
    "fig12": {"hit_rate_ratio_vs_f10": 1.58, "throughput_ratio_vs_f10": 1.15,
              "step_time_reduction_vs_f10": 0.156,
              "kv_hit_rate": {"f10_1024": 0.009, "ctb": 0.06}},
    "fig14": {"reduction_vs_vso": 0.443,
              "note": "RA2P's modes cut the overhead of vanilla streaming (VS, VSO) by up to "
                      "44.3%: the larger cut, against the slower VSO"},
    "fig15": {"reduction_vs_best_fixed": 0.686, "reduction_vs_worst_fixed": 0.776,
              "note": "ERS cuts RWT + TWT by 68.6-77.6% against the fixed ratios of Fig. 4: "
                      "the smaller cut against the best of them, the larger against the worst"},
}


@dataclass
class ExperimentResult:
    name: str
    headline: dict[str, Any]
    paper: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    series: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # plot -> label -> ys
    # run -> every GPU-second by what it did (SimResult.device_s)
    device_s: dict[str, dict[str, float]] = field(default_factory=dict)
    # run -> where a trained task's staleness-window place went, seconds (SimResult.window)
    window_s: dict[str, dict[str, float]] = field(default_factory=dict)


def device_shares(device_s: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Each run's GPU-seconds (``ExperimentResult.device_s``) as percentages of all of them
    (gpus x wall), a row per run."""
    rows = []
    for run, seconds in device_s.items():
        total = sum(seconds.values()) or 1.0
        rows.append({"run": run, **{k: round(100 * v / total, 1) for k, v in seconds.items()}})
    return rows


def window_means(results: dict[str, SimResult]) -> dict[str, dict[str, float]]:
    """Each run's window place per trained task, by part (``WindowSlots.means``), seconds, and
    ``occupancy``: the share of the window's places (x the run's wall time) that trained tasks
    held (absent without a window)."""
    out = {}
    for label, r in results.items():
        means = r.window.means()
        out[label] = {k: round(v, 2) for k, v in means.items()}
        if r.window_places and r.wall_s:
            place_s = means["slot_s"] * r.window.tasks
            out[label]["occupancy"] = round(place_s / (r.window_places * r.wall_s), 3)
    return out


def bounded(headline: dict[str, Any], scenario: SimScenario,
            results: dict[str, SimResult]) -> dict[str, dict[str, float]]:
    """Adds the scenario's goodput bound and each run's fraction of it to ``headline``
    (:mod:`tiderl.sim.bound`); returns each run's GPU-seconds by what they did."""
    bound = scenario_bound(scenario)
    headline["bound_tok_s"] = round(bound.tok_s, 1)
    headline["bound_limit"] = bound.limit
    headline["of_bound"] = {label: round(r.goodput_tok_s / bound.tok_s, 3)
                            for label, r in results.items()}
    return {label: {k: round(v, 1) for k, v in r.device_s.items()}
            for label, r in results.items()}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _row(label: str, result: SimResult) -> dict[str, Any]:
    return {
        "run": label,
        "goodput_tok_s": round(result.goodput_tok_s, 1),
        "wall_s": round(result.wall_s, 1),
        "trained_tokens": result.trained_tokens,
        "discarded_tokens": result.discarded_tokens,
        "kv_hit_rate": round(result.kv_hit_rate, 4),
        "rwt_s": round(result.rwt_s, 1),
        "twt_s": round(result.twt_s, 1),
    }


# --------------------------------------------------------------------------- fig4 / fig15


def fixed_split(scenario: SimScenario, ratio: float) -> SimResult:
    """Async at a fixed rollout/train split: ``ratio`` of the GPUs roll out."""
    return simulate(SYSTEMS["async"], scenario.with_sim(rollout_ratio=ratio))


def _fixed_splits(scenario: SimScenario, label: str) -> dict[str, Callable[[], SimResult]]:
    return {f"{label} {r}": partial(fixed_split, scenario, r) for r in RATIOS}


def fig4(scenario: SimScenario, progress: Progress | None = None) -> ExperimentResult:
    done = run_all(_fixed_splits(scenario, "async ratio"), progress)
    runs = dict(zip(RATIOS, done.values(), strict=True))
    headline = {f"ratio_{r}": {"rwt_s": round(res.rwt_s, 1), "twt_s": round(res.twt_s, 1),
                               "goodput_tok_s": round(res.goodput_tok_s, 1)}
                for r, res in runs.items()}
    series = {
        "rwt_s": {f"ratio {r}": [s.rwt_s for s in res.steps] for r, res in runs.items()},
        "twt_s": {f"ratio {r}": [s.twt_s for s in res.steps] for r, res in runs.items()},
    }
    rows = [_row(label, res) for label, res in done.items()]
    device_s = bounded(headline, scenario, done)
    return ExperimentResult("fig4", headline, PAPER["fig4"], rows, series, device_s)


def fig15(scenario: SimScenario, progress: Progress | None = None) -> ExperimentResult:
    done = run_all({"tiderl (ERS)": partial(simulate, SYSTEMS["tiderl"], scenario),
                    **_fixed_splits(scenario, "fixed")}, progress)
    device_s = bounded(headline := {}, scenario, done)
    ers = done.pop("tiderl (ERS)")
    fixed = dict(zip(RATIOS, done.values(), strict=True))
    waits = {r: res.rwt_s + res.twt_s for r, res in fixed.items()}
    ers_wait = ers.rwt_s + ers.twt_s
    headline |= {
        "ers_wait_s": round(ers_wait, 1),
        "fixed_wait_s": {str(r): round(w, 1) for r, w in waits.items()},
        "reduction_vs_best_fixed": round(1 - ers_wait / min(waits.values()), 3),
        "reduction_vs_worst_fixed": round(1 - ers_wait / max(waits.values()), 3),
    }
    series = {"wait_s": {"tiderl (ERS)": [s.rwt_s + s.twt_s for s in ers.steps]}}
    series["wait_s"].update({f"fixed {r}": [s.rwt_s + s.twt_s for s in res.steps]
                             for r, res in fixed.items()})
    rows = [_row("tiderl (ERS)", ers)] + [_row(label, res) for label, res in done.items()]
    return ExperimentResult("fig15", headline, PAPER["fig15"], rows, series, device_s)


# --------------------------------------------------------------------------- fig8 / table2


def _throughput_runs(scenario: SimScenario, key: str) -> dict[str, Callable[[], SimResult]]:
    """sync, async at each ratio, stream, tiderl; labelled "KEY SYSTEM" ("7b async 0.25")."""
    runs = {f"{key} sync": partial(simulate, SYSTEMS["sync"], scenario)}
    runs.update(_fixed_splits(scenario, f"{key} async"))
    for name in ("stream", "tiderl"):
        runs[f"{key} {name}"] = partial(simulate, SYSTEMS[name], scenario)
    return runs


def _throughput_ratios(done: dict[str, SimResult], key: str
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    sync, stream, tiderl = (done[f"{key} {name}"] for name in ("sync", "stream", "tiderl"))
    async_runs = {r: done[f"{key} async {r}"] for r in RATIOS}
    best_ratio = max(async_runs, key=lambda r: async_runs[r].goodput_tok_s)
    best_async = async_runs[best_ratio]
    runs = (("sync", sync), ("async", best_async), ("stream", stream), ("tiderl", tiderl))
    headline: dict[str, Any] = {
        "goodput_tok_s": {name: round(res.goodput_tok_s, 1) for name, res in runs},
        "async_best_ratio": best_ratio}
    for name, res in runs[:3]:
        headline[f"tiderl_over_{name}"] = _ratio(tiderl.goodput_tok_s, res.goodput_tok_s)
    rows = [_row("sync", sync)] + [_row(f"async {r}", res) for r, res in async_runs.items()]
    rows += [_row("stream", stream), _row("tiderl", tiderl)]
    return headline, rows


FIG8_MODELS = (("7b", "qwen2.5-7b"), ("14b", "qwen2.5-14b"))


def fig8(scenario: SimScenario, progress: Progress | None = None) -> ExperimentResult:
    runs: dict[str, Callable[[], SimResult]] = {}
    for key, model in FIG8_MODELS:
        runs.update(_throughput_runs(scenario.with_sim(model=model), key))
    done = run_all(runs, progress)
    headline, rows, device_s = {}, [], {}
    for key, model in FIG8_MODELS:
        headline[key], part_rows = _throughput_ratios(done, key)
        rows += [{"model": key, **row} for row in part_rows]
        mine = {label: r for label, r in done.items() if label.startswith(f"{key} ")}
        device_s |= bounded(headline[key], scenario.with_sim(model=model), mine)
        best = headline[key]["goodput_tok_s"]["async"]
        headline[key]["bound_over_best_fixed"] = round(headline[key]["bound_tok_s"] / best, 3)
    return ExperimentResult("fig8", headline, PAPER["fig8"], rows, device_s=device_s)


TABLE2_STEPS: tuple[tuple[str, SystemSpec], ...] = (
    ("stream", SYSTEMS["stream"]),
    ("+RA2P", SystemSpec(System.TIDERL, ctb=False, ra2p=True, ers=False)),
    ("+ERS", SystemSpec(System.TIDERL, ctb=False, ra2p=True, ers=True)),
    ("+CTB", SystemSpec(System.TIDERL, ctb=True, ra2p=True, ers=True)),
)


def table2(scenario: SimScenario, progress: Progress | None = None) -> ExperimentResult:
    results = list(run_all({label: partial(simulate, spec, scenario)
                            for label, spec in TABLE2_STEPS}, progress).items())
    headline: dict[str, Any] = {"goodput_k_tok_s": {}, "improvement": {}}
    previous = None
    for label, res in results:
        headline["goodput_k_tok_s"][label] = round(res.goodput_tok_s / 1e3, 2)
        if previous is not None:
            headline["improvement"][label] = round(res.goodput_tok_s / previous - 1, 3)
        previous = res.goodput_tok_s
    rows = [_row(label, res) for label, res in results]
    device_s = bounded(headline, scenario, dict(results))
    return ExperimentResult("table2", headline, PAPER["table2"], rows, device_s=device_s)


# --------------------------------------------------------------------------- fig12 / fig14

FIG12_TASKS = 1312


def fig12(scenario: SimScenario, progress: Progress | None = None) -> ExperimentResult:
    step = partial(simulate_rollout_step, scenario, FIG12_TASKS)
    runs = run_all({"ctb": partial(step, ctb=True, concurrency=None),
                    "f10_1024": partial(step, ctb=False, concurrency=1024),
                    "f9_512": partial(step, ctb=False, concurrency=512)}, progress)
    ctb, f10 = runs["ctb"], runs["f10_1024"]
    headline = {
        "kv_hit_rate": {k: round(v.kv_hit_rate, 4) for k, v in runs.items()},
        "gen_tok_s": {k: round(v.gen_tok_s, 1) for k, v in runs.items()},
        "step_s": {k: round(v.wall_s, 1) for k, v in runs.items()},
        "hit_rate_ratio_vs_f10": _ratio(ctb.kv_hit_rate, f10.kv_hit_rate),
        "throughput_ratio_vs_f10": _ratio(ctb.gen_tok_s, f10.gen_tok_s),
        "step_time_reduction_vs_f10": round(1 - ctb.wall_s / f10.wall_s, 3),
    }
    rows = [{"run": k, "kv_hit_rate": round(v.kv_hit_rate, 4), "gen_tok_s": round(v.gen_tok_s, 1),
             "step_s": round(v.wall_s, 1), "preemptions": v.num_preemptions,
             "recomputed_tokens": v.recomputed_tokens} for k, v in runs.items()]
    return ExperimentResult("fig12", headline, PAPER["fig12"], rows)


FIG14_MICRO_BATCHES, FIG14_TOKENS, FIG14_GPUS = 8, 8192, 4


def fig14(scenario: SimScenario, progress: Progress | None = None) -> ExperimentResult:
    ready = [0.0] * FIG14_MICRO_BATCHES
    modes = (StepMode.COLOCATED, StepMode.DECOUPLED, StepMode.VS, StepMode.VSO)
    times = run_all({mode.value: partial(simulate_trainer_step, scenario, mode, ready,
                                         FIG14_TOKENS, FIG14_GPUS) for mode in modes}, progress)
    best = min(times["colocated"], times["decoupled"])
    headline = {
        "step_s": {k: round(v, 3) for k, v in times.items()},
        "reduction_vs_vso": round(1 - best / times["vso"], 3),
        "reduction_vs_vs": round(1 - best / times["vs"], 3),
    }
    rows = [{"step_mode": k, "step_s": round(v, 3)} for k, v in times.items()]
    return ExperimentResult("fig14", headline, PAPER["fig14"], rows)


# --------------------------------------------------------------------------- registry

EXPERIMENTS: dict[str, Callable[[SimScenario, Progress | None], ExperimentResult]] = {
    "fig4": fig4, "fig8": fig8, "table2": table2, "fig12": fig12, "fig14": fig14, "fig15": fig15,
}


def run_experiment(name: str, scenario: SimScenario,
                   progress: Progress | None = None) -> ExperimentResult:
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {short(name)} (known: {', '.join(EXPERIMENTS)})")
    return EXPERIMENTS[name](scenario, progress)
