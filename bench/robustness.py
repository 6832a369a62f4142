"""Robustness of the job's HTTP servers under malformed input: counts per server.

    python bench/robustness.py [--seed 18] [--cases 1000] [--out bench/results/robustness.json]

Starts `tiderl engine serve --set model.size=tiny` (admin token set) and `tiderl env serve`
(token set) on free 127.0.0.1 ports and sends each the seeded fuzzers of ``tests/fuzz/inputs.py``
(the ones the fuzz tests send: random bytes, wrong types, huge values, out-of-vocabulary ids,
enormous prompts and bodies, deep JSON nesting, wrong content types, wrong routes and methods,
missing or wrong tokens), then bounded floods (engine: pins of distinct tasks; environment: starts
without and with the token), then a correct request (engine: a completion and an admin call;
environment: a whole episode). Per server: sent, 2xx, 4xx, 5xx, dropped connections, 4xx
without the one-line JSON error, malformed requests answered 2xx, correct-after, by kind.

The bus fuzzer lives in ``bench/robustness_bus.py``: when it is there, its
``fuzz_bus(count, seed) -> dict`` (as many messages as cases per server) is recorded under
"bus"; otherwise "bus" says it was skipped. Loopback only; the servers are stopped at the end
(about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' fuzzers and helpers
from machine import machine_info, write_result

from tests.fuzz.inputs import (
    FuzzCounts,
    engine_cases,
    engine_flood,
    engine_serves,
    env_cases,
    env_flood,
    env_serves,
    send_cases,
)
from tests.integration.serving import free_port, serving
from tiderl.models.vocab import VOCAB

ENGINE_TOKEN = "bench-admin-token"
ENV_TOKEN = "bench-env-token"
KV_TOKENS = 1024
CONTEXT = 4096  # the tiny model's max_position_embeddings
MAX_SESSIONS = 16
FLOOD = 300


def engine_server(seed: int, num_cases: int, folder: Path) -> dict:
    port = free_port()
    args = ["engine", "serve", "--set", "model.size=tiny", "--port", str(port),
            "--set", f"engine.kv_cache_tokens={KV_TOKENS}"]
    with serving(args, port, folder / "engine.log", env={"TIDERL_ADMIN_TOKEN": ENGINE_TOKEN}) \
            as (url, proc):
        cases = engine_cases(random.Random(seed), num_cases, vocab_size=len(VOCAB),
                             max_model_len=CONTEXT, token=ENGINE_TOKEN)
        fuzz, flood = _run(url, cases, engine_flood(FLOOD, ENGINE_TOKEN))
        correct = engine_serves(url, ENGINE_TOKEN)
        fuzz.correct_after = flood.correct_after = correct and proc.poll() is None
    return {"fuzz": fuzz.summary(), "flood_pins": flood.summary()}


def env_server(seed: int, num_cases: int, folder: Path) -> dict:
    port = free_port()
    args = ["env", "serve", "--envs", "guess,shop", "--port", str(port),
            "--max-sessions", str(MAX_SESSIONS)]
    with serving(args, port, folder / "env.log", env={"TIDERL_ENV_TOKEN": ENV_TOKEN}) \
            as (url, proc):
        cases = env_cases(random.Random(seed), num_cases, token=ENV_TOKEN)
        fuzz, refused = _run(url, cases, env_flood(FLOOD, None))
        admitted = asyncio.run(send_cases(url, env_flood(FLOOD, ENV_TOKEN), concurrency=16))
        correct = env_serves(url, ENV_TOKEN) and proc.poll() is None
        for counts in (fuzz, refused, admitted):
            counts.correct_after = correct
    return {"fuzz": fuzz.summary(), "flood_starts_without_token": refused.summary(),
            "flood_starts_with_token": admitted.summary()}


def _run(url: str, cases: list, flood: list) -> tuple[FuzzCounts, FuzzCounts]:
    began = time.monotonic()
    fuzz = asyncio.run(send_cases(url, cases))
    fuzz_s = time.monotonic() - began
    flooded = asyncio.run(send_cases(url, flood, concurrency=16))
    print(f"{url}: {fuzz.sent} cases in {fuzz_s:.1f} s, flood {flooded.sent}", file=sys.stderr)
    return fuzz, flooded


def bus(seed: int, count: int) -> dict:
    try:
        module = importlib.import_module("bench.robustness_bus")
    except ModuleNotFoundError as exc:
        if exc.name != "bench.robustness_bus":
            raise
        return {"skipped": "bench/robustness_bus.py is not there (the bus fuzzer)"}
    try:
        return module.fuzz_bus(count, seed)
    except Exception as exc:  # the bus fuzzer's own failure: the servers' counts still count
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--cases", type=int, default=1000, help="Malformed cases per server.")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "robustness.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tiderl-robustness-") as tmp:
        engine = engine_server(args.seed, args.cases, Path(tmp))
        env = env_server(args.seed, args.cases, Path(tmp))
    result = {"benchmark": "robustness", "when": datetime.now(timezone.utc).isoformat(),
              "machine": machine_info(), "seed": args.seed, "cases_per_server": args.cases,
              "transport": "HTTP/1.1 over loopback (httpx, uvicorn), 8 requests at a time "
                           "(floods 16)",
              "engine": engine, "env": env, "bus": bus(args.seed, args.cases)}
    write_result(args.out, result)
    clean = all(part["5xx"] == part["dropped"] == part["bad_error_body"] == 0
                and part["correct_after"] for server in (engine, env)
                for part in server.values())
    return 0 if clean and "error" not in result["bus"] else 1


if __name__ == "__main__":
    sys.exit(main())
