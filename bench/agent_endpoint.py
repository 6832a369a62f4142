"""The agent endpoint's costs (docs/agents.md), side by side in one run.

    python bench/agent_endpoint.py [--out bench/results/agent_endpoint.json] [--quick]

1. **Added latency per turn.** The job's environment daemon (``python -m tiderl.runtime env``)
   serves the native ``calc`` environment and the ``calc`` agent of
   ``tiderl.examples.calc_openai``, twice: on plain JSON through its client (``run_raw``) and on
   the OpenAI SDK (``run``). This process plays the rollout rank over the environment protocol
   (:class:`HTTPEnvClient`, as a rank does) with the same scripted turns on each (a calculator
   call, then the answer), alternating task by task. A turn's time is its ``/observation``'s
   round trip; the engine's time, the same on every path, is left out. The endpoint's added
   latency is the plain-JSON agent's p50 less the native p50 (target <= 2 ms): the answer going
   to the agent, its tool call and next request, and the conversation's comparison; the SDK
   agent's adds the SDK's own request and response models.
2. **Goodput of the calc job through the endpoint against the native calc job** (target >=
   0.9x): real jobs (``run_local``) identical but for the environment (native, the SDK agent, the
   plain-JSON agent), on a tiny Qwen2 with the byte-level BPE and chat template, alternating for
   three rounds; trained tokens per second of wall time, and past step 0 (the cold start); the
   ratios are the medians of the rounds' ratios.
3. **CTB against request-level admission for agents** with a lognormal tool latency (median 0.5 s,
   ``env.step_latency`` on agent turns): the KV prefix-cache hit rate and generation throughput,
   as ``bench/ctb.py`` reports them, on one rollout rank with 2,048 and 8,192 KV tokens.
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
from ctb import policy_figures, ratio_of
from jobs import run_job
from machine import machine_info, write_result

from tiderl.env.client import HTTPEnvClient
from tiderl.env.protocol import Completion
from tiderl.models.random_init import write_random_checkpoint
from tiderl.profile import build_profile, profile_to_dict

TARGET_ADDED_MS = 2.0
TARGET_GOODPUT_RATIO = 0.9
AGENT = {"calc-openai": {"entry": "tiderl.examples.calc_openai:run"},
         "calc-raw": {"entry": "tiderl.examples.calc_openai:run_raw"}}
AGENT_SET = 'env.agents={calc-openai: {entry: "tiderl.examples.calc_openai:run"}}'
RAW_SET = 'env.agents={calc-raw: {entry: "tiderl.examples.calc_openai:run_raw"}}'
KINDS = ("calc", "calc-raw", "calc-openai")  # native; the agent on plain JSON; on the SDK


# --------------------------------------------------------------------------- 1. turn latency


def start_env_daemon(root: Path) -> tuple[subprocess.Popen, str]:
    from tests.integration.serving import free_port, process_exit, wait_healthy

    profile = build_profile({"env": {"envs": list(KINDS), "agents": AGENT}})
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
                env: {"start": [], "turn": []} for env in KINDS}
            async with HTTPEnvClient(url, retries=0) as client:
                for seed in range(tasks + 5):
                    for env in KINDS:
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
    native = result["calc"]["turn_p50_ms"]
    added = round(result["calc-raw"]["turn_p50_ms"] - native, 3)
    with_sdk = round(result["calc-openai"]["turn_p50_ms"] - native, 3)
    note(f"turn p50: native {native} ms; the agent +{added} ms on plain JSON, +{with_sdk} ms "
         "on the OpenAI SDK")
    return {**result, "added_p50_ms": added, "added_with_sdk_p50_ms": with_sdk,
            "target_ms": TARGET_ADDED_MS, "meets_target": added <= TARGET_ADDED_MS}


# --------------------------------------------------------------------------- 2. goodput


JOB = ["runtime.num_ranks=3", "runtime.rollout_ranks=1", "ers.enabled=false",
       "job.group_size=4", "job.batch_min_groups=2", "job.batch_groups=2", "env.tasks={}",
       "env.options={}", "env.max_turns=4", "engine.max_new_tokens=24",
       "engine.kv_cache_tokens=4096", "report.plots=false"]


GOODPUT_ROUNDS = 3  # the three jobs alternate, round after round; the ratios are medians
GOODPUT_KINDS = {"native": ["env.envs=[calc]"],
                 "agent": ["env.envs=[calc-openai]", AGENT_SET],
                 "agent-raw": ["env.envs=[calc-raw]", RAW_SET]}


def goodput(steps: int, model: Path, root: Path, note, rounds: int = GOODPUT_ROUNDS) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in GOODPUT_KINDS}
    for k in range(rounds):
        for name, env in GOODPUT_KINDS.items():
            job = run_job(f"goodput-{name}-{k}", [*JOB, *env, f"model.path={model}"], steps,
                          root, note)
            s, later = job.summary, job.metrics[1:]
            runs[name].append({
                "trained_tokens": s["trained_tokens_total"], "wall_s": s["wall_time_s"],
                "goodput_tok_s": round(s["trained_tokens_total"] / s["wall_time_s"], 1),
                # past the cold start (step 0): steady state
                "goodput_after_step0_tok_s": round(
                    sum(m.trained_tokens for m in later) / sum(m.step_s for m in later), 1),
                "step_s": [round(m.step_s, 3) for m in job.metrics], "job_s": job.job_s})
            note(f"{name} round {k}: {runs[name][-1]['goodput_tok_s']} trained tok/s, "
                 f"{runs[name][-1]['goodput_after_step0_tok_s']} after step 0")

    def ratio(name: str, key: str) -> float:
        return round(statistics.median(run[key] / base[key] for run, base in
                                       zip(runs[name], runs["native"], strict=True)), 3)
    return {"runs": runs, "ratio": ratio("agent", "goodput_tok_s"),
            "ratio_after_step0": ratio("agent", "goodput_after_step0_tok_s"),
            "ratio_raw": ratio("agent-raw", "goodput_tok_s"),
            "ratio_raw_after_step0": ratio("agent-raw", "goodput_after_step0_tok_s"),
            "target": TARGET_GOODPUT_RATIO,
            "meets_target": ratio("agent", "goodput_tok_s") >= TARGET_GOODPUT_RATIO,
            "steps": steps, "rounds": rounds, "workload": JOB}


# --------------------------------------------------------------------------- 3. CTB for agents


MAX_NUM_SEQS = 32
CTB_WORKLOAD = [
    "env.envs=[calc-openai]", AGENT_SET, "env.tasks={}", "env.options={}", "env.max_turns=4",
    "env.step_latency.kind=lognormal", "env.step_latency.median_s=0.5",
    "env.step_latency.sigma=0.8", "engine.max_new_tokens=16",
    f"engine.max_num_seqs={MAX_NUM_SEQS}", "runtime.num_ranks=2", "runtime.rollout_ranks=1",
    "ers.enabled=false", "job.group_size=8", "job.batch_min_groups=4", "job.batch_groups=4",
    "report.plots=false",
]
CTB_POLICIES = {
    "ctb": ["ctb.policy=ctb"],
    "f-max": ["ctb.policy=request", f"ctb.request_concurrency={MAX_NUM_SEQS}"],
}


# KV for ~4 tasks' contexts (CTB keeps each waiting task's KV, so it admits ~4 at a time) and for
# ~16 (a step's 32 tasks still oversubscribe it)
KV_TOKENS = (2048, 8192)
CTB_STEPS = 4


def ctb_for_agents(steps: int, model: Path, root: Path, note) -> dict:
    out: dict[str, dict] = {}
    for kv in KV_TOKENS:
        side: dict[str, dict] = {}
        for name, policy in CTB_POLICIES.items():
            job = run_job(f"ctb-{name}-{kv}", [*CTB_WORKLOAD, *policy, f"model.path={model}",
                                               f"engine.kv_cache_tokens={kv}"], steps, root,
                          note)
            side[name] = policy_figures(job)
            note(f"{name} at {kv} KV tokens: hit rate {side[name]['kv_hit_rate']}, "
                 f"{side[name]['gen_tok_s']} gen tok/s, step {side[name]['step_s_mean']} s")
        ctb, base = side["ctb"], side["f-max"]
        out[f"kv_{kv}"] = {"policies": side, **{
            name: ratio_of(ctb[key], base[key]) for name, key in (
                ("hit_rate_ratio", "kv_hit_rate"), ("throughput_ratio", "gen_tok_s"),
                ("step_time_ratio", "step_s_mean"))}}
    return {**out, "steps": steps, "workload": CTB_WORKLOAD}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "agent_endpoint.json"))
    parser.add_argument("--quick", action="store_true", help="fewer tasks and steps (a check)")
    parser.add_argument("--only", choices=["latency", "goodput", "ctb"],
                        help="one part (printed, not written)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent.parent))  # tests.integration.serving

    def note(line: str) -> None:
        print(line, file=sys.stderr)
    tasks, steps = (20, 2) if args.quick else (200, 10)
    with tempfile.TemporaryDirectory(prefix="tiderl-agent-bench-") as tmp:
        root = Path(tmp)
        model = root / "model"
        write_random_checkpoint("tiny", model, tokenizer="bpe")
        (root / "env").mkdir()
        if args.only:
            part = {"latency": lambda: turn_latency(tasks, root / "env", note),
                    "goodput": lambda: goodput(steps, model, root, note),
                    "ctb": lambda: ctb_for_agents(min(steps, CTB_STEPS), model, root,
                                                  note)}[args.only]
            print(json.dumps(part(), indent=1))
            return
        result = {"turn_latency": turn_latency(tasks, root / "env", note),
                  "goodput": goodput(steps, model, root, note),
                  "ctb": ctb_for_agents(min(steps, CTB_STEPS), model, root, note),
                  "machine": {**machine_info(), "load_1m_before": os.getloadavg()[0]}}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
