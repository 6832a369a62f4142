"""End to end: one workload under the four runtime modes, side by side in one run.

Every mode is a real job (``tiderl.launch.job.run_local``: environment server, coordinator, four
rank processes on this machine) on the same profile, seed and task stream; only the mode and the
rollout split differ:

- ``sync``: verl-like; every rank rolls out, then trains (staleness 0, request-level rollout);
- ``async``: AReaL-like; a fixed rollout/trainer split, request-level rollout, whole global
  batches; swept over every split, the best one is the baseline;
- ``stream``: StreamRL-like; the fixed split, micro-batches streamed into VSO (a Ref/Actor swap
  per micro-batch);
- ``tiderl``: CTB, streamed micro-batches with RA2P's mode choice, and ERS;
- ``tiderl-predictive``: tiderl with ERS's predictive planner (``ers.planner=predictive``);
- ``tiderl-pinned`` and ``async-r2-pinned``: tiderl and the default split again with every rank
  pinned to cores of its own (``runtime.cpu_affinity=spread``; on 2 cores, 4 ranks pair up).

Workload (``--workload text``, the default): guess and shop tasks, a lognormal environment
latency, a small KV pool per rollout rank. ``--workload gui``: the paper's multimodal case on
this machine: a tiny Qwen2-VL (`model init --size tiny-vl --tokenizer bpe`) on the ``gui``
screens, heavier-tailed step latency and a slow start, the screenshot window (10, 5) cutting
training segments; the simulator's Table 2 (OSWorld, 4B VL model, 32 H100s) beside it, and only
the four modes (the async splits swept) without the pinned and predictive extras.

Figures per mode: goodput (trained tokens per second of the job), the training reward at
equal trained samples (mean over the second half of the sample range every mode reached),
RWT, TWT, KV hit rate, max staleness, and the machine's CPU busy share over the goodput window
(``/proc/stat``): with it, each mode's trained tokens per CPU-second and its ceiling, the goodput
it would reach at its own CPU cost per token with every core busy. A ratio target above
``ceiling(tiderl) / goodput(baseline)`` needs a cheaper token, not a better schedule.

Run: ``.venv/bin/python bench/e2e.py [--quick]`` or ``tiderl bench e2e``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from jobs import run_job
from machine import CpuSampler, machine_info, write_result

from tiderl.core.records import StepRecord
from tiderl.models.random_init import write_random_checkpoint

WORKLOAD = [
    "env.envs=[guess,shop]", "env.max_turns=8", "env.step_latency.kind=lognormal",
    "env.step_latency.median_s=0.15", "env.step_latency.sigma=1.0",
    "engine.kv_cache_tokens=4096", "engine.max_new_tokens=12",
    "runtime.num_ranks=4", "job.group_size=8", "job.batch_min_groups=2", "job.batch_groups=4",
]
GUI_WORKLOAD = [
    "env.envs=[gui]", "env.tasks={}", "env.options={}", "env.max_turns=12",
    "env.step_latency.kind=lognormal", "env.step_latency.median_s=0.3",
    "env.step_latency.sigma=1.0", "env.start_latency.kind=lognormal",
    "env.start_latency.median_s=0.5", "env.start_latency.sigma=0.7",
    "engine.kv_cache_tokens=4096", "engine.max_new_tokens=12",
    "runtime.num_ranks=4", "job.group_size=8", "job.batch_min_groups=2", "job.batch_groups=4",
]
FIXED_SPLIT = 2  # the stream baseline's split and tiderl's initial one


PINNED = "runtime.cpu_affinity=spread"
PINNED_TAG = "-pinned"


def _runs(num_ranks: int, extras: bool = True) -> list[tuple[str, list[str]]]:
    """Every mode unpinned; then (``extras``) tiderl with the predictive planner, and tiderl and
    the default split again with each rank pinned to its own cores
    (``runtime.cpu_affinity=spread``)."""
    runs = [("sync", ["runtime.system=sync", f"runtime.rollout_ranks={num_ranks}"])]
    runs += [(f"async-r{r}", ["runtime.system=async", f"runtime.rollout_ranks={r}"])
             for r in range(1, num_ranks)]
    runs += [("stream", ["runtime.system=stream", f"runtime.rollout_ranks={FIXED_SPLIT}"]),
             ("tiderl", ["runtime.system=tiderl", f"runtime.rollout_ranks={FIXED_SPLIT}"])]
    if not extras:
        return runs
    runs += [("tiderl-predictive", [*runs[-1][1], "ers.planner=predictive"]),
             ("tiderl-pinned", [*runs[-1][1], PINNED]),
             (f"async-r{FIXED_SPLIT}-pinned", [*runs[FIXED_SPLIT][1], PINNED])]
    return runs


def _reward_at(metrics: list[StepRecord], lo: int, hi: int) -> float:
    """Sample-weighted training reward of the steps whose cumulative samples end in (lo, hi]."""
    total = weight = 0.0
    seen = 0
    for m in metrics:
        seen += m.trained_samples
        if lo < seen <= hi:
            total += m.reward_mean * m.trained_samples
            weight += m.trained_samples
    return total / weight if weight else 0.0


def _cpu(cpu: CpuSampler, metrics_path: Path, last: StepRecord) -> dict:
    """CPU figures over the goodput window, launch to the last step's end: the window ends when
    the last record was written and is ``last.end_s`` long."""
    end = metrics_path.stat().st_mtime
    share = cpu.busy_share(end - last.end_s, end)
    if not share:
        return {"cpu_busy_share": None, "tokens_per_cpu_s": None, "ceiling_tok_s": None}
    cores = os.cpu_count() or 1
    return {"cpu_busy_share": round(share, 3),
            "tokens_per_cpu_s": round(last.trained_tokens_total / (share * cores * last.end_s), 1),
            "ceiling_tok_s": round(last.goodput_tok_s / share, 1)}


def run_bench(steps: int, root: Path, note, cpu: CpuSampler, workload: str = "text") -> dict:
    results: dict[str, dict] = {}
    series: dict[str, list[StepRecord]] = {}
    extras = workload == "text"
    overrides_of = WORKLOAD
    if workload == "gui":
        folder = root / "tiny-vl"
        write_random_checkpoint("tiny-vl", folder, tokenizer="bpe")
        overrides_of = [*GUI_WORKLOAD, f"model.path={folder}"]
    for name, overrides in _runs(4, extras):
        job = run_job(name, [*overrides_of, *overrides], steps, root, note)
        metrics, summary = job.metrics, job.summary
        series[name] = metrics
        results[name] = {
            "goodput_tok_s": summary["goodput_end_tok_s"],
            "rwt_s": round(summary["rwt_total_s"], 2), "twt_s": round(summary["twt_total_s"], 2),
            "kv_hit_rate": summary["kv_hit_rate_mean"],
            "staleness_max": summary["staleness_max"],
            "trained_samples": sum(m.trained_samples for m in metrics),
            "trained_tokens": summary["trained_tokens_total"],
            "wall_s": summary["wall_time_s"], "job_s": job.job_s,
            "modes_used": summary["modes"],
            "role_changes": summary["num_role_changes"],
            **_cpu(cpu, job.run_dir / "metrics.jsonl", metrics[-1]),
        }
    common = min(r["trained_samples"] for r in results.values())
    for name, metrics in series.items():
        results[name]["reward_at_equal_samples"] = round(
            _reward_at(metrics, common // 2, common), 4)
    asyncs = {k: v for k, v in results.items() if k.startswith("async") and PINNED_TAG not in k}
    best_async = max(asyncs, key=lambda k: asyncs[k]["goodput_tok_s"])
    modes = {"sync": results["sync"], "async": {**results[best_async], "split": best_async},
             "stream": results["stream"], "tiderl": results["tiderl"]}
    t = results["tiderl"]["goodput_tok_s"]
    default = f"async-r{FIXED_SPLIT}"
    ratios = {"tiderl_over_sync": round(t / results["sync"]["goodput_tok_s"], 3),
              "tiderl_over_async_best": round(t / results[best_async]["goodput_tok_s"], 3),
              "tiderl_over_default_split": round(t / results[default]["goodput_tok_s"], 3),
              "tiderl_over_stream": round(t / results["stream"]["goodput_tok_s"], 3)}
    if extras:
        ratios |= {"predictive_over_rules": round(
                       results["tiderl-predictive"]["goodput_tok_s"] / t, 3),
                   "pinned_tiderl_over_pinned_default_split": round(
                       results["tiderl-pinned"]["goodput_tok_s"]
                       / results[f"{default}-pinned"]["goodput_tok_s"], 3)}
    ceiling = results["tiderl"]["ceiling_tok_s"]
    bounds = {f"{key}_at_most": (round(ceiling / results[base]["goodput_tok_s"], 3)
                                 if ceiling else None)
              for key, base in (("tiderl_over_sync", "sync"),
                                ("tiderl_over_async_best", best_async),
                                ("tiderl_over_default_split", default))}
    sync_reward = results["sync"]["reward_at_equal_samples"]
    beside = {"simulator_table2": simulated_table2()} if workload == "gui" else {}
    return {
        "workload_name": workload, **beside,
        "modes": modes, "async_sweep": asyncs, "ratios": ratios, "cpu_bounds": bounds,
        "pinned": {k: v for k, v in results.items() if PINNED_TAG in k},
        "predictive": results.get("tiderl-predictive"),
        "targets": {"tiderl_over_sync": 1.5, "tiderl_over_async_best": 1.1,
                    "tiderl_over_default_split": 1.2, "reward_within_of_sync": 0.05},
        "reward_gap_vs_sync": round(results["tiderl"]["reward_at_equal_samples"] - sync_reward,
                                    4),
        "equal_samples": common, "steps": steps, "workload": overrides_of,
        "series": {k: [{key: m.to_dict()[key]
                        for key in ("step", "time_s", "goodput_tok_s", "reward_mean", "step_mode",
                                    "num_rollout")}
                       for m in v] for k, v in series.items()},
        "machine": machine_info(),
    }


def simulated_table2() -> dict:
    """The simulator's paper Table 2 (``profiles/sim/table2.yaml``: OSWorld, a 4B VL model on
    32 H100s; stream, +RA2P, +ERS, +CTB), with the paper's figures."""
    from tiderl.profile import load_profile
    from tiderl.profile.scenario import scenario_of
    from tiderl.sim.experiments import run_experiment

    result = run_experiment("table2", scenario_of(load_profile("sim/table2")))
    return {"simulated": result.headline, "paper": result.paper}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(result["modes"])
    left.bar(names, [result["modes"][n]["goodput_tok_s"] for n in names],
             color=["#888", "#4a7", "#a74", "#37c"])
    left.set_ylabel("goodput (trained tok/s)")
    left.set_title(f"goodput, best async = {result['modes']['async']['split']}")
    for name, points in result["series"].items():
        right.plot([p["time_s"] for p in points], [p["goodput_tok_s"] for p in points],
                   label=name, linewidth=1.2)
    right.set_xlabel("time (s)")
    right.set_ylabel("goodput (tok/s)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=("text", "gui"), default="text")
    parser.add_argument("--out", default=None,
                        help="default: results/e2e.json (text), results/e2e-gui.json (gui)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2 steps per mode (a check it runs)")
    args = parser.parse_args()
    steps = 2 if args.quick else args.steps
    name = "e2e.json" if args.workload == "text" else "e2e-gui.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)
    with tempfile.TemporaryDirectory(prefix="tiderl-e2e-") as tmp, CpuSampler() as cpu:
        result = run_bench(steps, Path(tmp), lambda line: print(line, file=sys.stderr), cpu,
                           args.workload)
    write_result(args.out, result)
    plot(result, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
