"""A real job (`tiderl launch`, its own process) training agents written against an API on a tiny
Qwen2 with the byte-level BPE and chat template, on `tiderl engine serve` servers (one per rank,
as the launcher starts them): the OpenAI-SDK ``calc`` agent (in the environment service) and the
command-line ``calc`` agent (a process per task) side by side, through two `tiderl rebalance`
moves (a server woken, a server put to sleep: tasks in flight go on on another rank, their agents
never notice), and a verifiers v1 environment (``tiderl.examples.calc_v1``: a taskset with a
tool server) trained through verifiers' own harness, interception server and token-in
TrainClient (:mod:`tiderl.env.verifiers_v1`); its harness's chat program is a PEP 723 script
whose packages uv fetches from the package index on a machine's first run."""

from __future__ import annotations

import json
import sys

from tests.chaos.chaos_job import (
    assert_each_group_once,
    assert_nothing_left,
    chaos,
    started,
    steps_done,
)
from tests.integration.test_rebalance import rebalance_applied, tiderl_here
from tiderl.examples.calc_common import problem
from tiderl.examples.calc_v1 import ROWS
from tiderl.models.folder import load_tokenizer
from tiderl.models.random_init import write_random_checkpoint

STEPS = 4  # two moves, each at a boundary, and a step after them
START_S = 300.0
AGENTS = ('{calc-openai: {entry: "tiderl.examples.calc_openai:run"}, '
          f'calc-cli: {{command: "{sys.executable} -m tiderl.examples.calc_cli"}}, '
          'calc-v1: {entry: "tiderl.env.verifiers_v1:run"}}')
JOB = ["env.envs=[calc-openai, calc-cli, calc-v1]", f"env.agents={AGENTS}", "env.tasks={}",
       "env.options={calc-v1: {taskset: tiderl.examples.calc_v1, max_tokens: 24, "
       "max_turns: 3}}", "env.step_latency.kind=none", "engine.max_new_tokens=24",
       "engine.backend=http", "logging.rollouts=true", "ers.enabled=false"]


def test_a_job_trains_sdk_command_line_and_verifiers_agents_through_rebalance_moves(tmp_path):
    model = tmp_path / "model"
    write_random_checkpoint("tiny", model, tokenizer="bpe")
    runs = tmp_path / "runs"
    with chaos(runs) as jobs:
        job, state, run_dir = started(jobs, runs, *JOB, f"model.path={model}", steps=STEPS)
        job.until(lambda: steps_done(run_dir) >= 1, "step 0", timeout_s=START_S)
        args = ("--run-root", str(runs))
        woken = rebalance_applied(state.job_id, "2", "1", args, run=tiderl_here)
        slept = rebalance_applied(state.job_id, "1", "2", args, run=tiderl_here)
        assert job.wait(START_S) == 0, job.output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["trained_samples"] > 0 and r["reward_mean"] is not None for r in records)
    assert woken["version"] < slept["version"]
    played = [json.loads(line) for path in sorted((run_dir / "rollouts").glob("rank-*.jsonl"))
              for line in path.read_text().splitlines() if line.strip()]
    assert {e["env"] for e in played} == {"calc-openai", "calc-cli", "calc-v1"}
    # each agent's loop: its later requests came as new messages appended to the same context,
    # never a new segment
    assert any(len(e["turns"]) >= 2 for e in played)
    assert not any(turn["restart"] for e in played for turn in e["turns"])
    # a verifiers episode trained what verifiers' renderer rendered for the row its seed chose:
    # the chat template around the taskset's system prompt and question
    tokenizer = load_tokenizer(model)
    for episode in (e for e in played if e["env"] == "calc-v1"):
        question, _ = problem(None, episode["seed"] % ROWS)
        text = tokenizer.decode(episode["turns"][0]["context_ids"], skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and question in text, text
        assert text.endswith("<|im_start|>assistant\n")
    assert_each_group_once(run_dir)
    assert_nothing_left(run_dir)
