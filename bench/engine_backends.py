"""Rollout on the embedded engine against engine servers (``engine.backend: http``), and the cost
of one weight update by disk.

    python bench/engine_backends.py [--out bench/results/engine_backends.json] [--steps 8]

1. The same job (the ``local`` profile's game, 4 ranks, ``--steps`` steps) with
   ``engine.backend`` embedded and http, alternating ``--rounds`` times: goodput (trained tokens
   per second of the job), the job's wall time from launch to its report, and the KV hit rate.
   With http every rank has a ``tiderl engine serve`` beside it (rollout ranks' awake, the
   others asleep), so the same 2 cores also carry the servers' processes.
2. One weight update of the tiny and the small model, median of ``--reps``: in process
   (``LLMEngine.update_weights``: the embedded backend's whole cost), and by disk to a running
   server: the export of the version's HF folder (``export_version``), the server's
   ``/tiderl/update_weights`` (read + load), and both together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

from tiderl.engine.clients import TideRLHTTPClient
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.launch.job import run_local
from tiderl.models.random_init import init_model, write_random_checkpoint
from tiderl.models.tokenizer import word_tokenizer
from tiderl.profile import load_profile
from tiderl.runtime.lineage import read_lineage
from tiderl.runtime.report import summarize
from tiderl.trainer.export import export_version
from tiderl.trainer.spawn import free_port

WORKLOAD = ["runtime.num_ranks=4", "runtime.rollout_ranks=2"]
BACKENDS = ("embedded", "http")


def job_round(backend: str, steps: int, root: Path, tag: str) -> dict:
    profile = load_profile("local", [*WORKLOAD, f"engine.backend={backend}",
                                     f"job.steps={steps}"])
    start = time.monotonic()
    job = run_local(profile, run_root=root, job_id=f"{backend}-{tag}")
    wall = time.monotonic() - start
    if job.exit_code != 0:
        raise SystemExit(f"{backend}: the job failed (see {job.run_dir}/logs)")
    summary = summarize(read_lineage(job.run_dir).metrics)
    return {"goodput_tok_s": summary["goodput_end_tok_s"], "job_s": round(wall, 1),
            "kv_hit_rate": summary["kv_hit_rate_mean"],
            "trained_tokens": summary["trained_tokens_total"]}


@contextlib.contextmanager
def engine_server(model: Path, log_path: Path) -> Iterator[str]:
    """A ``tiderl engine serve`` on a free loopback port, until it answers /health (it fails as
    soon as the process exits); stopped at the end."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "tiderl.cli.main", "engine", "serve", "--model", str(model),
            "--port", str(port)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"engine server exited: {log_path.read_text()[-500:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def update_costs(size: str, reps: int, root: Path) -> dict:
    """Medians, in seconds, of one update of ``size``'s weights."""
    model = init_model(size, seed=1)
    state, tokenizer = model.state_dict(), word_tokenizer()
    engine = LLMEngine(init_model(size, seed=0), EngineConfig(kv_cache_tokens=4096),
                       eos_token_id=None)
    in_process = []
    for version in range(1, reps + 2):
        t0 = time.perf_counter()
        engine.update_weights(state, version)
        in_process.append(time.perf_counter() - t0)
    folder = root / f"{size}-model"
    write_random_checkpoint(size, folder)
    export, load = [], []
    with engine_server(folder, root / f"{size}-server.log") as url:
        async def loads() -> None:
            async with TideRLHTTPClient(url) as client:
                for version in range(1, reps + 2):
                    t0 = time.perf_counter()
                    path = export_version(state, model.config, tokenizer, root / size, version)
                    t1 = time.perf_counter()
                    await client.update_weights(str(path), version)
                    export.append(t1 - t0)
                    load.append(time.perf_counter() - t1)
        asyncio.run(loads())
    total = [a + b for a, b in zip(export, load, strict=True)]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    def median(values: list[float]) -> float:
        return round(statistics.median(values[1:]), 4)  # the first is a warm-up

    return {"bytes": nbytes, "in_process_s": median(in_process), "export_s": median(export),
            "server_load_s": median(load), "disk_total_s": median(total),
            "disk_over_in_process": round(median(total) / median(in_process), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "engine_backends.json"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rounds: dict[str, list[dict]] = {b: [] for b in BACKENDS}
    with tempfile.TemporaryDirectory(prefix="tiderl-backends-") as tmp:
        root = Path(tmp)
        for i in range(args.rounds):
            for backend in BACKENDS:  # alternating: drift on the machine hits both
                print(f"{backend}, round {i + 1}: {args.steps} steps ...", file=sys.stderr)
                rounds[backend].append(job_round(backend, args.steps, root, str(i)))
        updates = {size: update_costs(size, args.reps, root) for size in ("tiny", "small")}

    def mean(backend: str, key: str) -> float:
        return round(statistics.mean(r[key] for r in rounds[backend]), 1)

    result = {
        "jobs": {"workload": ["local", *WORKLOAD], "steps": args.steps, "rounds": rounds,
                 "goodput_tok_s": {b: mean(b, "goodput_tok_s") for b in BACKENDS},
                 "job_s": {b: mean(b, "job_s") for b in BACKENDS},
                 "http_over_embedded": round(mean("http", "goodput_tok_s")
                                             / mean("embedded", "goodput_tok_s"), 3)},
        "weight_update": updates,
        "machine": machine_info(),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
