"""`tiderl bench ...`: side-by-side benchmarks that write JSON under bench/results/."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import typer
from rich.console import Console

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.options import count_option
from tiderl.cli.output import JsonFlag, Output, table
from tiderl.core.quote import short

app = typer.Typer(help="Benchmarks, side by side in one run: JSON + table.", no_args_is_help=True)


@app.command("ra2p")
def ra2p(
    out: Path = typer.Option(Path("bench/results/ra2p.json"), "--out",
                             help="Where the JSON result is written (the PNG goes beside it)."),
    quick: bool = typer.Option(False, "--quick",
                               help="2 micro-batches of 12x32 tokens, a 2-cell grid, no "
                                    "repeats (a check that it runs, not a measurement)."),
    json_mode: bool = JsonFlag,
) -> None:
    """RA2P modes (colocated, decoupled, vanilla streaming) on local ranks vs the cost model."""
    output = Output(json_mode)
    output.note("running bench/ra2p.py on 4 rank processes (about 4 minutes on 2 cores) ...")
    result = _run_script("ra2p", out, ["--quick"] * quick, output)
    output.result(result, lambda console: _render_ra2p(console, result))


@app.command("ctb")
def ctb(
    out: Path = typer.Option(Path("bench/results/ctb.json"), "--out",
                             help="Where the JSON result is written (the PNG goes beside it)."),
    steps: int = count_option(3, "--steps", minimum=1, help="Training steps of each job."),
    quick: bool = typer.Option(False, "--quick",
                               help="2 steps per job (a check that it runs, not a measurement)."),
    variant: list[str] = typer.Option(
        [], "--variant", metavar="NAME=OVERRIDES",
        help="NAME=OVERRIDE[,OVERRIDE]: one more CTB job with these profile overrides, reported "
        "over CTB and the request-level runs (repeatable)."),
    json_mode: bool = JsonFlag,
) -> None:
    """CTB vs request-level rollout at fixed concurrency (paper Fig. 12/13): real jobs on the
    embedded engine where KV is scarce; KV hit rate, generation throughput, step time."""
    output = Output(json_mode)
    output.note(f"running bench/ctb.py: {4 + len(variant)} jobs of 2 ranks each "
                "(minutes on 2 cores) ...")
    args = ["--steps", str(steps)] + ["--quick"] * quick
    args += [arg for spec in variant for arg in ("--variant", spec)]
    result = _run_script("ctb", out, args, output)
    output.result(result, lambda console: _render_ctb(console, result))


@app.command("engine")
def engine(
    out: Path = typer.Option(Path("bench/results/engine.json"), "--out",
                             help="Where the JSON result is written."),
    quick: bool = typer.Option(False, "--quick", help="Skip batch 64 (about half the time)."),
    json_mode: bool = JsonFlag,
) -> None:
    """Embedded engine decode throughput vs transformers, prefix reuse, pinned vs request-level."""
    output = Output(json_mode)
    output.note("running bench/engine.py (about 1-2 minutes on 2 cores) ...")
    result = _bench_script("engine").run_bench(quick, output.note)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    output.note(f"wrote {out}")
    output.result(result, lambda console: _render_engine(console, result))


E2E_WORKLOADS = ("text", "gui")


@app.command("e2e")
def e2e(
    out: Path = typer.Option(None, "--out", show_default=False,
                             help="Where the JSON result is written (the PNG goes beside it); "
                                  "default bench/results/e2e.json, e2e-gui.json for gui."),
    workload: str = typer.Option("text", "--workload",
                                 help="text: guess and shop on the tiny Qwen2; gui: the gui "
                                      "screens on a tiny Qwen2-VL, the simulator's Table 2 "
                                      "beside it."),
    steps: int = count_option(10, "--steps", minimum=1, help="Training steps of each job."),
    quick: bool = typer.Option(False, "--quick",
                               help="2 steps per job (a check that it runs, not a measurement)."),
    json_mode: bool = JsonFlag,
) -> None:
    """The same workload under sync, async (every split), stream and tiderl: real jobs, side by
    side; goodput, reward at equal trained samples, RWT, TWT, KV hit rate."""
    output = Output(json_mode)
    if workload not in E2E_WORKLOADS:
        raise CLIError(f"tiderl bench e2e: --workload {short(workload)}: expected one of "
                       f"{', '.join(E2E_WORKLOADS)}", EXIT_USAGE)
    out = out or Path("bench/results") / ("e2e.json" if workload == "text" else "e2e-gui.json")
    output.note(f"running bench/e2e.py --workload {workload}: {9 if workload == 'text' else 6} "
                "jobs of 4 ranks each (minutes on 2 cores) ...")
    result = _run_script("e2e", out, ["--steps", str(steps), "--workload", workload]
                         + ["--quick"] * quick, output)
    output.result(result, lambda console: _render_e2e(console, result))


def _run_script(name: str, out: Path, extra: list[str], output: Output) -> dict:
    """Run ``bench/NAME.py`` as its own process (it spawns rank processes); its JSON result."""
    args = [sys.executable, str(_script_path(name)), "--out", str(out.resolve()), *extra]
    done = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CLIError(f"bench {name} failed: {last}")
    output.note(f"wrote {out} and {out.with_suffix('.png')}")
    return json.loads(out.read_text())


def _script_path(name: str) -> Path:
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    if not path.exists():
        raise CLIError(f"tiderl bench {name}: {path} not found (benchmarks run from a checkout)")
    return path


def _bench_script(name: str) -> ModuleType:
    """The benchmark script ``bench/NAME.py`` of the source checkout, imported by path (a script
    that spawns rank processes runs as its own process instead: see ``ra2p``)."""
    path = _script_path(name)
    spec = importlib.util.spec_from_file_location(f"tiderl_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render_engine(console: Console, result: dict) -> None:
    ours, hf = result["decode_tok_s"], result["hf_generate_tok_s"]
    console.print(table("decode tokens/s (greedy, 64 new tokens)",
                        ("config/dtype/batch", "engine", "transformers", "ratio"),
                        [(k, v, hf[k], round(v / hf[k], 2)) for k, v in ours.items()]))
    split = result.get("b32_fp32_split", {})

    def times(side: dict | None) -> str:
        return f"{side['prefill_ms']} / {side['decode_step_ms']}" if side else "-"

    console.print(table("batch 32, float32: prefill ms / decode step ms",
                        ("model/threads", "engine", "transformers", "tok/s ratio",
                         "engine, torch kernels"),
                        [(k, times(v["engine"]), times(v["transformers"]), v["speedup"],
                          times(v.get("engine_torch_kernels"))) for k, v in split.items()]))
    mixed = result.get("mixed_step", {})
    console.print(table("a prompt joining decoding sequences: step ms (small, float32)",
                        ("batch/chunk", "apart", "padded into one", "decode only"),
                        [(k, v["apart_ms"], v["padded_ms"],
                          mixed[k.split("/")[0] + "/decode_only_ms"])
                         for k, v in mixed.items() if isinstance(v, dict)]))
    reuse = result["prefix_reuse"]
    console.print(table("prefix reuse", ("figure", "value"), list(reuse.items())))
    rows = [(name, *(result[name][k] for k in ("hit_rate", "decode_tok_s", "num_preemptions")))
            for name in ("request_level", "pinned_budget")]
    ratios = result["pinned_vs_request_level"]
    rows.append(("pinned / request-level", ratios["hit_rate_ratio"],
                 ratios["throughput_ratio"], ""))
    console.print(table("multi-turn workload, KV pool < working set",
                        ("policy", "hit rate", "decode tok/s", "preemptions"), rows))


def _render_ctb(console: Console, result: dict) -> None:
    rows = [(name, v["kv_hit_rate"], v["gen_tok_s"], v["step_s_mean"], v["generated_tokens"])
            for name, v in result["policies"].items()]
    console.print(table("rollout policies (same jobs but for ctb.policy)",
                        ("policy", "KV hit", "gen tok/s", "step s", "generated"), rows))
    paper = result["paper"]
    console.print(table("CTB / request-level at max concurrency", ("ratio", "measured", "paper"),
                        [(k, v, paper.get(k, "-")) for k, v in result["ratios"].items()]))
    for name, ratios in result.get("variants", {}).items():
        console.print(table(f"{name} ({', '.join(ratios['overrides'])}) over the runs beside it",
                            ("ratio", "measured"),
                            [(k, v) for k, v in ratios.items() if k != "overrides"]))


def _render_ra2p(console: Console, result: dict) -> None:
    modes = result["modes"]
    console.print(table("step time, all micro-batches ready at the start (s)",
                        ("step_mode", "measured", "cost model", "error"),
                        [(m, v["measured_s"], v["predicted_s"], f"{v['error']:.1%}")
                         for m, v in modes.items()]))
    rows = [(c["ras"], c["tprm_s"], c["measured_s"]["CM"], c["measured_s"]["DM"], c["fastest"],
             c["chosen"]) for c in result["grid"]]
    console.print(table("(RAS, TPRM) grid", ("RAS", "TPRM s", "CM s", "DM s", "fastest",
                                               "chosen"), rows))
    console.print(f"prediction error max {result['prediction_error_max']:.1%} (target 15%); "
                  f"chosen = fastest in {result['chosen_is_fastest_fraction']:.0%} of cells "
                  "(target 90%)")


def _render_e2e(console: Console, result: dict) -> None:
    rows = [(mode, v.get("split", ""), v["goodput_tok_s"], v["reward_at_equal_samples"],
             v["rwt_s"], v["twt_s"], v["kv_hit_rate"], v["staleness_max"],
             v.get("cpu_busy_share", "-"))
            for mode, v in result["modes"].items()]
    console.print(table("modes (goodput in trained tokens/s)",
                        ("step_mode", "split", "goodput", "reward", "RWT s", "TWT s", "KV hit",
                         "staleness", "CPU busy"), rows))
    targets, bounds = result["targets"], result.get("cpu_bounds", {})
    console.print(table("ratios", ("ratio", "measured", "target", "CPU ceiling"),
                        [(k, v, targets.get(k, "-"), bounds.get(f"{k}_at_most", "-"))
                         for k, v in result["ratios"].items()]))
    table2 = result.get("simulator_table2")
    if table2:
        simulated, paper = table2["simulated"], table2["paper"]
        console.print(table("simulator, paper Table 2 (k tok/s)", ("system", "simulated", "paper"),
                            [(k, v, paper["goodput_k_tok_s"].get(k, "-"))
                             for k, v in simulated["goodput_k_tok_s"].items()]))
