"""`tiderl launch --resume` refusals, each one line before anything starts (the resume itself
runs in tests/chaos: `make chaos`)."""

from __future__ import annotations

import os
import time

import yaml

from tests.integration.test_cli import assert_one_line_error, tiderl
from tests.unit.test_job_checkpoints import checkpoint
from tiderl.launch.local import JobRecord, ProcessRecord
from tiderl.profile import load_profile, profile_to_dict


def stopped_job(run_root, steps: int, version: int, pid: int = 0):
    """A run folder as a killed job leaves it: job.json, profile.yaml, a checkpoint."""
    run_dir = run_root / "20261202-000000-tiderl"
    (run_dir / "checkpoints").mkdir(parents=True)
    profile = load_profile("local", [f"job.steps={steps}", "runtime.num_ranks=2",
                                     "runtime.rollout_ranks=1"])
    (run_dir / "profile.yaml").write_text(yaml.safe_dump(profile_to_dict(profile)))
    processes = [ProcessRecord("coordinator", "coordinator", pid, str(run_dir / "logs/c.log"),
                               [])] if pid else []
    JobRecord(run_dir.name, str(run_dir), time.time(), processes).save()
    checkpoint(run_dir / "checkpoints", version)
    return run_dir


def test_resume_refuses_an_unknown_job_a_running_one_a_finished_one_and_a_new_shape(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    line = assert_one_line_error(tiderl("launch", "--resume", "nope", "--run-root", str(root)), 2)
    assert "no job 'nope'" in line
    assert "no job with a checkpoint" in assert_one_line_error(
        tiderl("launch", "--resume", "latest", "--run-root", str(root)), 2)
    run_dir = stopped_job(root, steps=4, version=4)
    line = assert_one_line_error(tiderl("launch", "--resume", "latest", "--run-root", str(root)),
                                 1)
    assert "is complete: step 4 of 4 (--set job.steps=N trains on)" in line
    line = assert_one_line_error(tiderl("launch", "--resume", run_dir.name, "--run-root",
                                        str(root), "--set", "runtime.num_ranks=3"), 2)
    assert "runtime.num_ranks is 2 in the job, --set makes it 3" in line
    alive = stopped_job(tmp_path / "other", steps=8, version=2, pid=os.getpid())
    line = assert_one_line_error(tiderl("launch", "--resume", str(alive)), 2)
    assert "is running (coordinator); stop it first" in line
