"""CTB vs request-level rollout at fixed concurrency (paper Fig. 12/13) on the embedded engine.

    python bench/ctb.py [--out bench/results/ctb.json] [--steps N] [--quick]
                        [--variant NAME=OVERRIDE[,OVERRIDE]]...

Real jobs (``tiderl.launch.job.run_local``: environment server, coordinator, rank processes),
identical but for ``ctb.policy``, side by side in one run:

- ``ctb``: budget admission, pins and pause/resume (``ctb.policy=ctb``), each task's KV pinned
  for its whole environment wait (the default);
- ``ctb-release``: the same, releasing tasks that wait for their environment longer than their
  context takes to recompute (``ctb.release_waiting=true``);
- ``f-max``: request-level rollout at the engine's maximum concurrency
  (``ctb.policy=request``, ``ctb.request_concurrency`` = ``engine.max_num_seqs``), the paper's
  F10 (its engine's maximum, 1024);
- ``f-half``: the same at half of it, the paper's F9 (512);
- each ``--variant NAME=OVERRIDE[,OVERRIDE]``: ``ctb`` with these profile overrides too,
  reported over ``ctb``, ``f-max`` and ``f-half`` (an A/B in the same run).

Workload: KV is scarce and contexts grow: the shop environment (long observations: result pages
and product pages), up to 10 turns, a lognormal environment pause per turn, one rollout rank
with a 4096-token KV pool, 64 tasks a step (8 groups of 8), the small model. ERS is off, so
every policy rolls out on the same rank for the whole job. Figures per policy: the KV
prefix-cache hit rate (hits / lookups, in tokens, per step, averaged), generation throughput
(output tokens per second the rollout rank could generate: the job's wall time less its rollout
wait, RWT, for the trainer), mean step time; and the ratios CTB / f-max (paper: 1.58x hit rate,
1.15x throughput, 15.6% shorter steps) and CTB / f-half. A plot goes beside the JSON.

Run: ``.venv/bin/python bench/ctb.py [--quick]`` or ``tiderl bench ctb``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from jobs import parse_variants, run_job
from machine import machine_info, write_result

MAX_NUM_SEQS = 32
WORKLOAD = [
    "model.size=small", "env.envs=[shop]", "env.tasks={}", "env.options={}", "env.max_turns=10",
    "env.step_latency.kind=lognormal", "env.step_latency.median_s=0.2",
    "env.step_latency.sigma=0.8", "engine.kv_cache_tokens=4096", "engine.max_new_tokens=8",
    f"engine.max_num_seqs={MAX_NUM_SEQS}", "runtime.num_ranks=2", "runtime.rollout_ranks=1",
    "ers.enabled=false", "job.group_size=8", "job.batch_min_groups=8", "job.batch_groups=8",
]
POLICIES = {
    "ctb": ["ctb.policy=ctb"],
    "ctb-release": ["ctb.policy=ctb", "ctb.release_waiting=true"],
    "f-max": ["ctb.policy=request", f"ctb.request_concurrency={MAX_NUM_SEQS}"],
    "f-half": ["ctb.policy=request", f"ctb.request_concurrency={MAX_NUM_SEQS // 2}"],
}
PAPER = {"hit_rate_ratio": 1.58, "throughput_ratio": 1.15, "step_time_reduction": 0.156}


def run_bench(steps: int, root: Path, note, variants: dict[str, list[str]] | None = None) -> dict:
    results: dict[str, dict] = {}
    policies = {**POLICIES, **{name: [*POLICIES["ctb"], *extra]
                               for name, extra in (variants or {}).items()}}
    for name, overrides in policies.items():
        job = run_job(name, [*WORKLOAD, *overrides], steps, root, note)
        results[name] = policy_figures(job)
        note(f"{name}: hit rate {results[name]['kv_hit_rate']}, "
             f"{results[name]['gen_tok_s']} gen tok/s, step {results[name]['step_s_mean']} s")
    ctb, base = results["ctb"], results["f-max"]
    ratios = {
        "hit_rate_ratio": ratio_of(ctb["kv_hit_rate"], base["kv_hit_rate"]),
        "throughput_ratio": ratio_of(ctb["gen_tok_s"], base["gen_tok_s"]),
        "step_time_reduction": round(1 - ctb["step_s_mean"] / base["step_s_mean"], 3),
        "hit_rate_ratio_vs_half": ratio_of(ctb["kv_hit_rate"], results["f-half"]["kv_hit_rate"]),
        "throughput_ratio_vs_half": ratio_of(ctb["gen_tok_s"], results["f-half"]["gen_tok_s"]),
        "release_throughput_ratio": ratio_of(results["ctb-release"]["gen_tok_s"],
                                             ctb["gen_tok_s"]),
        "release_hit_rate_ratio": ratio_of(results["ctb-release"]["kv_hit_rate"],
                                           ctb["kv_hit_rate"]),
    }
    by_variant = {
        name: {"overrides": extra, **{
            f"{figure}_over_{base}": ratio_of(results[name][key], results[base][key])
            for figure, key in (("throughput", "gen_tok_s"), ("hit_rate", "kv_hit_rate"),
                                ("step_s", "step_s_mean"))
            for base in ("ctb", "f-max", "f-half")}}
        for name, extra in (variants or {}).items()}
    return {"policies": results, "ratios": ratios, "variants": by_variant, "paper": PAPER,
            "meets_target": (ratios["hit_rate_ratio"] or 0) >= PAPER["hit_rate_ratio"]
            and (ratios["throughput_ratio"] or 0) >= PAPER["throughput_ratio"],
            # the paper's CTB also beats the half concurrency (F9) on both
            "beats_half": (ratios["hit_rate_ratio_vs_half"] or 0) >= 1
            and (ratios["throughput_ratio_vs_half"] or 0) >= 1,
            "steps": steps, "workload": WORKLOAD, "machine": machine_info()}


def policy_figures(job) -> dict:
    """A policy's figures from its job: hit rate, generation throughput, step time."""
    metrics, summary = job.metrics, job.summary
    lookups = [m.kv_hit_rate for m in metrics if m.kv_hit_rate is not None]
    return {
        "kv_hit_rate": summary["kv_hit_rate_mean"],
        "kv_hit_rate_per_step": lookups,
        # per second the rollout rank could generate: the job's wall time less its waits for
        # the trainer (RWT: the staleness bound holds it back)
        "gen_tok_s": round(summary["generated_tokens_total"]
                           / (summary["wall_time_s"] - summary["rwt_total_s"]), 1),
        "gen_tok_s_wall": round(summary["generated_tokens_total"] / summary["wall_time_s"], 1),
        "rwt_s": round(summary["rwt_total_s"], 2),
        "generated_tokens": summary["generated_tokens_total"],
        "step_s_mean": round(sum(m.step_s for m in metrics) / len(metrics), 3),
        "wall_s": summary["wall_time_s"], "job_s": job.job_s,
        "trained_samples": sum(m.trained_samples for m in metrics),
        "rollout_saturated_s": round(sum(m.rollout_saturated_s or 0 for m in metrics), 2),
        "ctb_pauses": sum(m.ctb_pauses or 0 for m in metrics),
        "ctb_releases": sum(m.ctb_releases or 0 for m in metrics),
    }


def ratio_of(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    figures = (("kv_hit_rate", "KV prefix-cache hit rate"), ("gen_tok_s", "generated tok/s"),
               ("step_s_mean", "mean step time (s)"))
    fig, axes = plt.subplots(1, len(figures), figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, figures, strict=True):
        ax.bar(names, [result["policies"][n][key] or 0 for n in names],
               color=["#37c", "#a74", "#888"])
        ax.set_title(label)
        ax.set_ylim(bottom=0)
    r = result["ratios"]
    fig.suptitle(f"CTB vs request-level at max concurrency: hit rate {r['hit_rate_ratio']}x, "
                 f"throughput {r['throughput_ratio']}x (paper 1.58x, 1.15x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ctb.json"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 steps per policy (a check)")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=OVERRIDE[,OVERRIDE]: ctb with these overrides too")
    args = parser.parse_args()
    try:
        variants = parse_variants(args.variant, POLICIES.__contains__)
    except ValueError as error:
        parser.error(str(error))
    steps = 2 if args.quick else args.steps
    with tempfile.TemporaryDirectory(prefix="tiderl-ctb-") as tmp:
        result = run_bench(steps, Path(tmp), lambda line: print(line, file=sys.stderr), variants)
    write_result(args.out, result)
    plot(result, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
