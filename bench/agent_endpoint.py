"""The agent endpoint's costs (docs/agents.md), side by side in one run.

    python bench/agent_endpoint.py [--out bench/results/agent_endpoint.json] [--quick]

1. **Added latency per turn.** The job's environment daemon (``python -m tiderl.runtime env``)
   serves the native ``calc`` environment and the OpenAI-SDK ``calc`` agent
   (``tiderl.examples.calc_openai``); this process plays the rollout rank over the environment
   protocol (:class:`HTTPEnvClient`, as a rank does) with the same scripted turns on both (a
   calculator call, then the answer), alternating task by task. A turn's time is its
   ``/observation``'s round trip; the engine's time, the same on both paths, is left out. The
   endpoint's added latency is the agent's p50 less the native p50 (target <= 2 ms): the answer
   going to the agent, the SDK's parsing, its tool call and next request, and the conversation's
   comparison.
2. **Goodput of the calc job through the endpoint against the native calc job** (target >=
   0.9x): two real jobs (``run_local``) identical but for the environment, on a tiny Qwen2 with the
   byte-level BPE and chat template; trained tokens per second of wall time.
3. **CTB against request-level admission for agents** with a lognormal tool latency (median 0.5 s,
   ``env.step_latency`` on agent turns): the KV prefix-cache hit rate and generation throughput,
   as ``bench/ctb.py`` reports them, with KV scarce (2,048 tokens on one rollout rank).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from ctb import policy_figures
from jobs import run_job
from machine import machine_info, write_result

from tiderl.env.client import HTTPEnvClient
from tiderl.env.protocol import Completion
from tiderl.models.random_init import write_random_checkpoint
from tiderl.profile import build_profile, profile_to_dict

TARGET_ADDED_MS = 2.0
TARGET_GOODPUT_RATIO = 0.9
AGENT = {"calc-openai": {"entry": "tiderl.examples.calc_openai:run"}}
AGENT_SET = 'env.agents={calc-openai: {entry: "tiderl.examples.calc_openai:run"}}'


# --------------------------------------------------------------------------- 1. turn latency


def start_env_daemon(root: Path) -> tuple[subprocess.Popen, str]:
    from tests.integration.serving import free_port, process_exit, wait_healthy

    profile = build_profile({"env": {"envs": ["calc", "calc-openai"], "agents": AGENT}})
    (root / "profile.yaml").write_text(yaml.safe_dump(profile_to_dict(profile)))
    port = free_port()
    log = root / "env.log"
    proc = subprocess.Popen([sys.executable, "-m", "tiderl.runtime", "env", "--run-dir",
                             str(root), "--port", str(port)], stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process_exit(proc, log))
    return proc, url


def call_text(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


async def play_task(client: HTTPEnvClient, env: str, seed: int) -> tuple[float, list[float]]:
    """One calc task, scripted: (its start's seconds, its turns' seconds)."""
    began = time.perf_counter()
    start = await client.start(env, "2", seed, task_id=f"{env}-{seed}", wait_s=60)
    started = time.perf_counter() - began
    expression = re.search(r"What is (.*)\?", start.observation).group(1)
    turns, ids = [], [11, 12, 13]
    began = time.perf_counter()
    tool = await client.step(start.session, call_text(expression),
                             Completion(ids, [-0.5] * 3, "stop", 40), wait_s=60)
    turns.append(time.perf_counter() - began)
    value = tool.messages[-1].text()
    began = time.perf_counter()
    end = await client.step(start.session, f"<answer>{value}</answer>",
                            Completion(ids, [-0.5] * 3, "stop", 60), wait_s=60)
    turns.append(time.perf_counter() - began)
    assert end.done and end.reward == 1.0, (env, end)
    await client.end(start.session)
    return started, turns


def turn_latency(tasks: int, root: Path, note) -> dict:
    proc, url = start_env_daemon(root)
    try:
        async def main() -> dict:
            out: dict[str, dict[str, list[float]]] = {
                env: {"start": [], "turn": []} for env in ("calc", "calc-openai")}
            async with HTTPEnvClient(url, retries=0) as client:
                for seed in range(tasks + 5):
                    for env in ("calc", "calc-openai"):
                        started, turns = await play_task(client, env, seed)
                        if seed >= 5:  # the first tasks warm the service and the SDK
                            out[env]["start"].append(started)
                            out[env]["turn"] += turns
            return out
        samples = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait()

    def ms(values: list[float], q: float) -> float:
        return round(statistics.quantiles(values, n=100)[int(q) - 1] * 1e3, 3) if q != 50 \
            else round(statistics.median(values) * 1e3, 3)

    result = {env: {"turn_p50_ms": ms(s["turn"], 50), "turn_p90_ms": ms(s["turn"], 90),
                    "start_p50_ms": ms(s["start"], 50), "turns": len(s["turn"])}
              for env, s in samples.items()}
    added = round(result["calc-openai"]["turn_p50_ms"] - result["calc"]["turn_p50_ms"], 3)
    note(f"turn p50: native {result['calc']['turn_p50_ms']} ms, agent "
         f"{result['calc-openai']['turn_p50_ms']} ms: +{added} ms")
    return {**result, "added_p50_ms": added, "target_ms": TARGET_ADDED_MS,
            "meets_target": added <= TARGET_ADDED_MS}


# --------------------------------------------------------------------------- 2. goodput


JOB = ["runtime.num_ranks=3", "runtime.rollout_ranks=1", "ers.enabled=false",
       "job.group_size=4", "job.batch_min_groups=2", "job.batch_groups=2", "env.tasks={}",
       "env.options={}", "env.max_turns=4", "engine.max_new_tokens=24",
       "engine.kv_cache_tokens=4096", "report.plots=false"]


def goodput(steps: int, model: Path, root: Path, note) -> dict:
    out = {}
    for name, env in (("native", ["env.envs=[calc]"]),
                      ("agent", ["env.envs=[calc-openai]", AGENT_SET])):
        job = run_job(f"goodput-{name}", [*JOB, *env, f"model.path={model}"], steps, root, note)
        s = job.summary
        out[name] = {"trained_tokens": s["trained_tokens_total"], "wall_s": s["wall_time_s"],
                     "goodput_tok_s": round(s["trained_tokens_total"] / s["wall_time_s"], 1),
                     "step_s_mean": round(statistics.mean(m.step_s for m in job.metrics), 3),
                     "job_s": job.job_s}
        note(f"{name}: {out[name]['goodput_tok_s']} trained tok/s")
    ratio = round(out["agent"]["goodput_tok_s"] / out["native"]["goodput_tok_s"], 3)
    return {**out, "ratio": ratio, "target": TARGET_GOODPUT_RATIO,
            "meets_target": ratio >= TARGET_GOODPUT_RATIO, "steps": steps, "workload": JOB}


# --------------------------------------------------------------------------- 3. CTB for agents


MAX_NUM_SEQS = 32
CTB_WORKLOAD = [
    "env.envs=[calc-openai]", AGENT_SET, "env.tasks={}", "env.options={}", "env.max_turns=4",
    "env.step_latency.kind=lognormal", "env.step_latency.median_s=0.5",
    "env.step_latency.sigma=0.8", "engine.kv_cache_tokens=2048", "engine.max_new_tokens=16",
    f"engine.max_num_seqs={MAX_NUM_SEQS}", "runtime.num_ranks=2", "runtime.rollout_ranks=1",
    "ers.enabled=false", "job.group_size=8", "job.batch_min_groups=4", "job.batch_groups=4",
    "report.plots=false",
]
CTB_POLICIES = {
    "ctb": ["ctb.policy=ctb"],
    "f-max": ["ctb.policy=request", f"ctb.request_concurrency={MAX_NUM_SEQS}"],
}


def ctb_for_agents(steps: int, model: Path, root: Path, note) -> dict:
    out = {}
    for name, policy in CTB_POLICIES.items():
        job = run_job(f"ctb-{name}", [*CTB_WORKLOAD, *policy, f"model.path={model}"], steps,
                      root, note)
        out[name] = policy_figures(job)
        note(f"{name}: hit rate {out[name]['kv_hit_rate']}, {out[name]['gen_tok_s']} gen tok/s")
    ctb, base = out["ctb"], out["f-max"]

    def ratio(key: str) -> float | None:
        return round(ctb[key] / base[key], 3) if ctb[key] is not None and base[key] else None
    return {"policies": out, "hit_rate_ratio": ratio("kv_hit_rate"),
            "throughput_ratio": ratio("gen_tok_s"), "steps": steps, "workload": CTB_WORKLOAD}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "agent_endpoint.json"))
    parser.add_argument("--quick", action="store_true", help="fewer tasks and steps (a check)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent.parent))  # tests.integration.serving

    def note(line: str) -> None:
        print(line, file=sys.stderr)
    tasks, steps = (20, 2) if args.quick else (200, 4)
    with tempfile.TemporaryDirectory(prefix="tiderl-agent-bench-") as tmp:
        root = Path(tmp)
        model = root / "model"
        write_random_checkpoint("tiny", model, tokenizer="bpe")
        (root / "env").mkdir()
        result = {"turn_latency": turn_latency(tasks, root / "env", note),
                  "goodput": goodput(steps, model, root, note),
                  "ctb": ctb_for_agents(steps, model, root, note),
                  "machine": {**machine_info(), "load_1m_before": os.getloadavg()[0]}}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
