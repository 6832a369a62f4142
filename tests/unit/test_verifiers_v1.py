"""The verifiers v1 runner's own checks (the job that trains through it is in
tests/e2e/test_agent_jobs.py): its options, and the command's one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiderl.env.verifiers_v1 import EpisodeFailed, _checked, _taskset_id


def test_options_get_their_defaults_and_unknown_or_missing_ones_are_refused():
    assert _checked({"taskset": "gsm8k"}) == {
        "taskset": "gsm8k", "harness": "null", "tool_parser": "qwen3", "max_tokens": None,
        "max_turns": None}
    for bad in ({}, {"taskset": 3}, {"taskset": "gsm8k", "max_token": 5}):
        with pytest.raises(EpisodeFailed, match="expected options taskset, harness"):
            _checked(bad)


def test_a_dotted_taskset_is_imported_and_named_by_its_last_part():
    assert _taskset_id("gsm8k") == "gsm8k" and _taskset_id("owner/gsm8k") == "owner/gsm8k"
    assert _taskset_id("tiderl.examples.calc_v1") == "calc_v1"
    assert sys.modules["calc_v1"] is sys.modules["tiderl.examples.calc_v1"]
    with pytest.raises(EpisodeFailed, match="another module is already imported as 'types'"):
        _taskset_id("tiderl.core.types")  # the stdlib's types is imported by name
    with pytest.raises(EpisodeFailed, match=r"taskset tiderl\.env\.nope: No module named"):
        _taskset_id("tiderl.env.nope")


def run_command(task: dict | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TIDERL_TASK"}
    if task is not None:
        env["TIDERL_TASK"] = json.dumps(task)
    return subprocess.run([sys.executable, "-m", "tiderl.env.verifiers_v1"], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("task", "said"), [
    (None, "verifiers_v1: TIDERL_TASK is not a task (it is set by a TideRL job's environment "
           "service)"),
    ({"options": {"tasks": "calc"}}, 'verifiers_v1: expected options taskset, harness, '
     'tool_parser, max_tokens, max_turns with a taskset, got {"tasks": "calc"}'),
])
def test_the_command_fails_its_task_with_one_line(task, said):
    done = run_command(task)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == said
