"""Real jobs (`tiderl launch`, its own process) training agents written against an API on a tiny
Qwen2 with the byte-level BPE and chat template: the OpenAI-SDK ``calc`` agent through a
`tiderl rebalance` move (its tasks go on on another rank, the agent never notices), and the
command-line ``calc`` agent, a process per task."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.chaos.chaos_job import assert_each_group_once, assert_nothing_left, chaos, started
from tests.chaos.chaos_job import steps_done as steps_in
from tests.integration.test_rebalance import rebalance_applied, tiderl_here
from tiderl.models.random_init import write_random_checkpoint

STEPS = 4
START_S = 300.0
AGENT_JOB = ["env.tasks={}", "env.options={}", "env.step_latency.kind=none",
             "engine.max_new_tokens=24", "logging.rollouts=true", "ers.enabled=false"]


def agent_job(name: str, agent: str) -> list[str]:
    return [*AGENT_JOB, f"env.envs=[{name}]", f"env.agents={{{name}: {agent}}}"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-bpe")
    write_random_checkpoint("tiny", folder, tokenizer="bpe")
    return folder


def episodes(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((run_dir / "rollouts").glob("rank-*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_job_trains_the_openai_sdk_calc_agent_through_a_rebalance_move(model, tmp_path):
    runs = tmp_path / "runs"
    overrides = agent_job("calc-openai", '{entry: "tiderl.examples.calc_openai:run"}')
    with chaos(runs) as jobs:
        job, state, run_dir = started(jobs, runs, *overrides, f"model.path={model}",
                                      steps=STEPS)
        job.until(lambda: steps_in(run_dir) >= 1, "step 0", timeout_s=START_S)
        args = ("--run-root", str(runs))
        rebalance_applied(state.job_id, "2", "1", args, run=tiderl_here)
        moved = rebalance_applied(state.job_id, "1", "2", args, run=tiderl_here)
        assert job.wait(START_S) == 0, job.output
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["trained_samples"] > 0 and r["reward_mean"] is not None for r in records)
    played = episodes(run_dir)
    assert played and {e["env"] for e in played} == {"calc-openai"}
    # the agent's loop: a second request (after a tool result or a nudge) came as new messages
    # appended to the same context, never a new segment
    assert any(len(e["turns"]) >= 2 for e in played)
    assert not any(turn["restart"] for e in played for turn in e["turns"])
    assert moved["version"] >= 1
    assert_each_group_once(run_dir)
    assert_nothing_left(run_dir)


def test_a_job_trains_a_command_line_agent_a_process_per_task(model, tmp_path):
    """On `tiderl engine serve` servers, one per rank, as the launcher starts them."""
    runs = tmp_path / "runs"
    command = f'{{command: "{sys.executable} -m tiderl.examples.calc_cli"}}'
    with chaos(runs) as jobs:
        job, _, run_dir = started(jobs, runs, *agent_job("calc-cli", command),
                                  f"model.path={model}", "engine.backend=http", steps=2)
        assert job.wait(START_S) == 0, job.output
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["trained_samples"] > 0 for r in records)
    assert {e["env"] for e in episodes(run_dir)} == {"calc-cli"}
    assert_each_group_once(run_dir)
    assert_nothing_left(run_dir)
