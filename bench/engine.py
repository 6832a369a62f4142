"""Embedded engine: decode throughput vs transformers, prefix reuse, pinned vs request-level.

    python bench/engine.py [--out bench/results/engine.json] [--quick]

1. Decode tokens/s (generated tokens / wall time of the whole batch, 32-token prompts included)
   of our engine vs transformers ``generate`` on the same weights: greedy, exactly 64 new tokens
   (no eos), batch 1/8/32/64, tiny and small, float32 and bfloat16, best of 5 timed runs after a
   warm-up, the two sides taking turns. Target: >= 2x at batch 32 (tiny and small, float32).
   At batch 32 in float32 also the split: prefill (prompts and first token) and each further
   decode step, both sides, at 2 threads and at 1, and the engine on plain torch kernels
   (``engine.kernels=torch``, its path without a C++ compiler) beside them.
2. Prefix reuse: prompt tokens computed for a turn that extends a cached context vs the same
   prompt with an empty cache. Mixed steps: a prompt joining 16 or 32 decoding sequences, with
   decode and prefill attention apart (the engine) vs padded into one problem.
3. Multi-turn tasks with environment pauses (asyncio sleeps) on a KV pool smaller than the working
   set: request-level scheduling at a fixed concurrency (no pins) vs token-budget admission with
   pinning (a task is admitted only when its final footprint fits the pool; pinned while active).

Runs on ``torch.set_num_threads(2)``, as on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

from tiderl.engine.config import EngineConfig
from tiderl.engine.kv_cache_manager import PinRefused
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.request import SamplingParams
from tiderl.models.folder import save_model
from tiderl.models.random_init import init_model

PROMPT_LEN, NEW_TOKENS = 32, 64
BATCHES = (1, 8, 32, 64)
TARGET_SPEEDUP = 2.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def engine_runner(model, batch: int, prompts: torch.Tensor, kernels: str = "native"
                  ) -> Callable[[int], float]:
    """Seconds for the batch to generate ``n`` tokens each on a fresh engine's prompts (a new
    leading token per call, so no prefix is cached); ``kernels``: ``engine.kernels``."""
    config = EngineConfig(kv_cache_tokens=max(2048, 2 * batch * (PROMPT_LEN + NEW_TOKENS)),
                          block_size=16, max_num_seqs=max(64, batch),
                          max_num_batched_tokens=max(2048, batch * PROMPT_LEN), kernels=kernels)
    engine = LLMEngine(model, config, eos_token_id=None)
    tags = iter(range(1, 10**6))

    def once(max_tokens: int) -> float:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        tag, start = next(tags), time.perf_counter()
        requests = [engine.add_request(f"r{i}", [tag, *p.tolist()], sampling)
                    for i, p in enumerate(prompts)]
        while not all(r.is_finished for r in requests):
            engine.step()
        return time.perf_counter() - start

    return once


def hf_runner(hf_model, prompts: torch.Tensor) -> Callable[[int], float]:
    def once(max_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(prompts, attention_mask=torch.ones_like(prompts),
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    return once


def best_times(runners: list[Callable[[int], float]], tokens: int, repeats: int = 5
               ) -> list[float]:
    """Each runner's best time for ``tokens`` tokens over ``repeats`` rounds, the runners taking
    turns within each round (this machine's speed drifts by up to 2x over a minute: turns put
    both sides under the same drift)."""
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(repeats):
        for once, out in zip(runners, times, strict=True):
            out.append(once(tokens))
    return [min(out) for out in times]


def tokens_per_s(runners: list[Callable[[int], float]], batch: int) -> list[float]:
    for once in runners:
        once(8)  # warm-up
    return [batch * NEW_TOKENS / t for t in best_times(runners, NEW_TOKENS)]


def split_times(runners: list[Callable[[int], float]]) -> list[dict]:
    """Prefill (the prompts and the first token) and each further decode step of each runner,
    from its best runs of 1 and of NEW_TOKENS tokens."""
    for once in runners:
        once(8)
    firsts, fulls = best_times(runners, 1), best_times(runners, NEW_TOKENS)
    return [{"prefill_ms": round(first * 1e3, 1),
             "decode_step_ms": round((full - first) / (NEW_TOKENS - 1) * 1e3, 3)}
            for first, full in zip(firsts, fulls, strict=True)]


def hf_copy(model, dtype: torch.dtype):
    import transformers

    with tempfile.TemporaryDirectory() as folder:
        save_model(model, folder)
        hf = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=dtype)
    hf.generation_config.eos_token_id = None
    return hf.eval()


def decode_section(quick: bool, note: Callable[[str], None]) -> dict:
    ours, hf, speedup, skipped = {}, {}, {}, []
    for size in ("tiny", "small"):
        for dname, dtype in DTYPES.items():
            model = init_model(size).to(dtype)
            hf_model = hf_copy(init_model(size), dtype)
            for batch in BATCHES:
                key = f"{size}/{dname}/b{batch}"
                if quick and batch == 64:
                    skipped.append(key)
                    continue
                prompts = torch.randint(10, 1000, (batch, PROMPT_LEN),
                                        generator=torch.Generator().manual_seed(batch))
                ours[key], hf[key] = (round(v, 1) for v in tokens_per_s(
                    [engine_runner(model, batch, prompts), hf_runner(hf_model, prompts)], batch))
                note(f"decode {key}: engine {ours[key]} tok/s, transformers {hf[key]} tok/s")
            key = f"{size}/{dname}/b32"
            speedup[f"{size}/{dname}"] = round(ours[key] / hf[key], 2)
    return {"decode_tok_s": ours, "hf_generate_tok_s": hf, "speedup_vs_hf_b32": {
        **speedup, "headline_tiny_fp32": speedup["tiny/fp32"]},
        "meets_target": min(speedup[f"{size}/fp32"] for size in ("tiny", "small"))
        >= TARGET_SPEEDUP, "skipped": skipped, "b32_fp32_split": split_section(note)}


def split_section(note: Callable[[str], None]) -> dict:
    """Batch 32, float32: where the time goes (prefill vs each decode step), engine and
    transformers, at 2 threads and at 1 (each side's better thread count may differ); and the
    engine with its non-GEMM parts in plain torch (``engine.kernels=torch``, what an engine runs
    without a C++ compiler) beside them."""
    out = {}
    for size in ("tiny", "small"):
        model, hf_model = init_model(size), hf_copy(init_model(size), torch.float32)
        prompts = torch.randint(10, 1000, (32, PROMPT_LEN),
                                generator=torch.Generator().manual_seed(32))
        for threads in (2, 1):
            torch.set_num_threads(threads)
            key = f"{size}/threads{threads}"
            runners = [engine_runner(model, 32, prompts), hf_runner(hf_model, prompts),
                       engine_runner(model, 32, prompts, kernels="torch")]
            ours, theirs, plain = split_times(runners)
            ours_tok_s, theirs_tok_s, plain_tok_s = tokens_per_s(runners, 32)
            out[key] = {"engine": ours, "transformers": theirs, "engine_torch_kernels": plain,
                        "engine_tok_s": round(ours_tok_s, 1),
                        "transformers_tok_s": round(theirs_tok_s, 1),
                        "engine_torch_kernels_tok_s": round(plain_tok_s, 1)}
            out[key]["speedup"] = round(out[key]["engine_tok_s"]
                                        / out[key]["transformers_tok_s"], 2)
            note(f"split {key}: {out[key]}")
    torch.set_num_threads(2)
    return out


def prefix_section() -> dict:
    model = init_model("tiny")
    config = EngineConfig(kv_cache_tokens=4096, block_size=16, max_num_batched_tokens=2048)
    rng = random.Random(0)
    context = [rng.randrange(10, 1000) for _ in range(500)]
    turn = SamplingParams(max_tokens=12, temperature=0.0)

    def run_turn(engine: LLMEngine, prompt: list[int]) -> tuple[int, float, list[int]]:
        before = engine.metrics().prompt_tokens_computed
        start = time.perf_counter()
        request = engine.add_request("task", prompt, turn)
        while not request.is_finished:
            engine.step()
        elapsed = time.perf_counter() - start
        computed = engine.metrics().prompt_tokens_computed - before
        return computed, elapsed, request.output_token_ids

    warm = LLMEngine(model, config, eos_token_id=None)
    _, _, outputs = run_turn(warm, context)
    with_cache, without_cache = [], []
    for _ in range(3):  # each: a new 32-token observation after the cached turn
        prompt2 = [*context, *outputs, *(rng.randrange(10, 1000) for _ in range(32))]
        with_cache.append(run_turn(warm, prompt2)[:2])
        without_cache.append(run_turn(LLMEngine(model, config, eos_token_id=None), prompt2)[:2])
    return {"context_tokens": len(prompt2), "computed_with_cache": with_cache[0][0],
            "computed_without_cache": without_cache[-1][0],
            "turn_s_with_cache": round(sorted(s for _, s in with_cache)[1], 4),
            "turn_s_without_cache": round(sorted(s for _, s in without_cache)[1], 4)}


# -- mixed steps -----------------------------------------------------------------------------------

def mixed_section(note: Callable[[str], None]) -> dict:
    """One step of 16 or 32 sequences decoding (200-token prompts, 5 tokens out) that a new
    prompt of 40 or 300 tokens joins, small model, float32, best of 4: decode and prefill
    attention apart (the engine) vs padded into one problem (every decode row padded to the
    chunk), and the decode step without the chunk."""
    model = init_model("small")
    config = EngineConfig(kv_cache_tokens=16384, block_size=16, max_num_seqs=64,
                          max_num_batched_tokens=2048)
    engine = LLMEngine(model, config, eos_token_id=None)
    runner, gen, ids = engine.runner, torch.Generator().manual_seed(0), iter(range(10**6))
    split = runner._parts

    def padded(positions, batch):  # the whole step as one problem
        return [runner._part(positions, batch, decode=bool((batch.query_start_loc.diff()
                                                            == 1).all()))]

    def step_ms(batch: int, chunk: int) -> float:
        times = []
        for _ in range(4):
            requests = [engine.add_request(f"d{next(ids)}", torch.randint(
                10, 1000, (200,), generator=gen).tolist(), SamplingParams(50, 0.0))
                for _ in range(batch)]
            for _ in range(5):
                engine.step()
            if chunk:
                engine.add_request(f"p{next(ids)}", torch.randint(
                    10, 1000, (chunk,), generator=gen).tolist(), SamplingParams(1, 0.0))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            for request in requests:
                engine.scheduler.abort_request(request.request_id)
            while engine.scheduler.has_unfinished:
                engine.step()
        return round(min(times) * 1e3, 1)

    out = {}
    for batch in (16, 32):
        out[f"b{batch}/decode_only_ms"] = step_ms(batch, 0)
        for chunk in (40, 300):
            runner._parts = padded
            one = step_ms(batch, chunk)
            runner._parts = split
            out[f"b{batch}/chunk{chunk}"] = {"apart_ms": step_ms(batch, chunk),
                                             "padded_ms": one}
        note(f"mixed steps b{batch}: {out}")
    return out


# -- multi-turn workload ---------------------------------------------------------------------------

WORKLOAD = {"tasks": 24, "turns": (3, 7), "prompt": (96, 160), "observation": (24, 64),
            "new_tokens": 16, "pause_s": (0.05, 0.25), "kv_cache_tokens": 3072, "block_size": 16,
            "request_level_concurrency": 12}


def make_tasks(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    w = WORKLOAD
    tasks = []
    for i in range(w["tasks"]):
        turns = rng.randint(*w["turns"])
        obs = [[rng.randrange(10, 1000) for _ in range(rng.randint(*w["observation"]))]
               for _ in range(turns - 1)]
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(*w["prompt"]))]
        pauses = [rng.uniform(*w["pause_s"]) for _ in range(turns - 1)]
        footprint = len(prompt) + turns * w["new_tokens"] + sum(map(len, obs))
        tasks.append({"id": f"task{i}", "prompt": prompt, "obs": obs, "pauses": pauses,
                      "footprint": footprint})
    return tasks


async def run_task(engine: LLMEngine, task: dict) -> None:
    context = list(task["prompt"])
    sampling = SamplingParams(max_tokens=WORKLOAD["new_tokens"], temperature=0.0)
    for turn in range(len(task["obs"]) + 1):
        out = await engine.generate(task["id"], context, sampling)
        context += out.output_ids
        if turn < len(task["obs"]):
            await asyncio.sleep(task["pauses"][turn])  # the environment step
            context += task["obs"][turn]


async def request_level(engine: LLMEngine, tasks: list[dict]) -> None:
    slots = asyncio.Semaphore(WORKLOAD["request_level_concurrency"])

    async def one(task: dict) -> None:
        async with slots:
            await run_task(engine, task)

    await asyncio.gather(*map(one, tasks))


async def pinned_budget(engine: LLMEngine, tasks: list[dict]) -> None:
    block = WORKLOAD["block_size"]
    budget = WORKLOAD["kv_cache_tokens"]
    used = 0
    room = asyncio.Condition()

    async def one(task: dict) -> None:
        nonlocal used
        need = -(-task["footprint"] // block) * block
        async with room:
            await room.wait_for(lambda: used + need <= budget)
            used += need
        with contextlib.suppress(PinRefused):  # it would starve a request in the engine: the
            engine.pin(task["id"])  # task runs unpinned
        try:
            await run_task(engine, task)
        finally:
            engine.unpin(task["id"])
            async with room:
                used -= need
                room.notify_all()

    await asyncio.gather(*map(one, tasks))


def workload_mode(policy) -> dict:
    model = init_model("tiny")
    config = EngineConfig(kv_cache_tokens=WORKLOAD["kv_cache_tokens"],
                          block_size=WORKLOAD["block_size"], max_num_seqs=64,
                          max_num_batched_tokens=1024)
    engine = LLMEngine(model, config, eos_token_id=None)
    tasks = make_tasks()

    async def main() -> float:
        start = time.perf_counter()
        await policy(engine, tasks)
        elapsed = time.perf_counter() - start
        await engine.close()
        return elapsed

    elapsed = asyncio.run(main())
    m = engine.metrics()
    return {"wall_s": round(elapsed, 2), "hit_rate": round(m.prefix_cache_hits
                                                           / m.prefix_cache_queries, 4),
            "decode_tok_s": round(m.decode_tokens / elapsed, 1),
            "total_tok_s": round((m.decode_tokens + m.prompt_tokens_computed) / elapsed, 1),
            "prompt_tokens_computed": m.prompt_tokens_computed,
            "decode_tokens": m.decode_tokens, "num_preemptions": m.num_preemptions,
            "prefix_cache_queries": m.prefix_cache_queries,
            "prefix_cache_hits": m.prefix_cache_hits}


def workload_section() -> dict:
    tasks = make_tasks()
    req, pin = workload_mode(request_level), workload_mode(pinned_budget)
    return {"workload": {**WORKLOAD, "working_set_tokens": sum(t["footprint"] for t in tasks)},
            "request_level": req, "pinned_budget": pin,
            "pinned_vs_request_level": {
                "hit_rate_ratio": round(pin["hit_rate"] / req["hit_rate"], 3),
                "throughput_ratio": round(pin["decode_tok_s"] / req["decode_tok_s"], 3)}}


def run_bench(quick: bool = False, note: Callable[[str], None] = lambda _: None) -> dict:
    """Every section, side by side; returns the JSON-ready result."""
    torch.set_num_threads(2)
    start = time.perf_counter()
    result = decode_section(quick, note)
    result["prefix_reuse"] = prefix_section()
    note(f"prefix reuse: {result['prefix_reuse']}")
    result["mixed_step"] = mixed_section(note)
    result |= workload_section()
    note(f"pinned vs request-level: {result['pinned_vs_request_level']}")
    result["total_wall_s"] = round(time.perf_counter() - start, 1)
    result["machine"] = machine_info() | {"torch_threads": torch.get_num_threads()}
    result["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.json"))
    parser.add_argument("--quick", action="store_true", help="Skip batch 64.")
    args = parser.parse_args()
    result = run_bench(args.quick, lambda line: sys.stderr.write(line + "\n"))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
