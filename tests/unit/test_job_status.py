"""job_status: a local job's state word, steps and processes, from hand-made run folders (its
job.json, metrics.jsonl and events.jsonl) and PIDs of this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.unit.test_runtime_lineage import EVENTS
from tests.unit.test_runtime_report import _metrics
from tiderl.launch.control import job_status
from tiderl.launch.local import JobRecord, ProcessRecord


def _ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _job(tmp_path, pids: list[int], steps_done: int = 2, stop: dict | None = None,
         info: dict | None = None) -> JobRecord:
    run_dir = tmp_path / "job"
    run_dir.mkdir(parents=True)
    processes = [ProcessRecord(f"p{i}", "rank", pid, str(run_dir / "logs" / f"p{i}.log"), [])
                 for i, pid in enumerate(pids)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m.to_dict()) + "\n"
                                                   for m in _metrics()[:steps_done]))
    events = [{"kind": "start"}, *([{"kind": "stop", **stop}] if stop is not None else [])]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return JobRecord("job", str(run_dir), time.time(), processes,
                     {"steps": 5} if info is None else info)


@pytest.mark.parametrize(("stop", "word"), [
    ({"reason": "done"}, "done"),
    ({"reason": "coordinator failed", "state": "failed"}, "failed"),
    ({"reason": "stopped", "state": "stopped"}, "stopped"),
    ({"reason": "interrupted", "state": "interrupted"}, "interrupted"),
    (None, "crashed"),  # no stop event: its coordinator was killed
])
def test_a_job_that_runs_no_more_says_how_it_ended(tmp_path, stop, word):
    ended = _ended_pid()
    status = job_status(_job(tmp_path, [ended, ended], stop=stop))
    assert (status.state, status.num_running, status.num_processes) == (word, 0, 2)
    assert (status.steps_done, status.steps_total, status.where) == (2, 5, "local")
    assert status.process_states == {"p0": None, "p1": None}


def test_a_running_job_is_running_or_partial(tmp_path):
    status = job_status(_job(tmp_path / "a", [os.getpid()], stop=None))
    assert (status.state, status.num_running, status.num_processes) == ("running", 1, 1)
    assert status.process_states["p0"] in ("R", "S")
    status = job_status(_job(tmp_path / "b", [os.getpid(), _ended_pid()], steps_done=0,
                             info={}))
    assert (status.state, status.num_running, status.steps_done, status.steps_total) == (
        "partial", 1, 0, None)


def test_a_resumed_job_counts_the_steps_and_the_stop_of_its_live_lineage(tmp_path):
    """Stopped after step 3, resumed from the checkpoint of step 2, killed before the resumed
    run recorded a step: 2 steps done, and crashed (the stop in the file is the run's before)."""
    job = _job(tmp_path, [_ended_pid()], steps_done=4)
    (tmp_path / "job" / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in EVENTS[:11]))  # up to the resume event
    status = job_status(job)
    assert (status.state, status.steps_done) == ("crashed", 2)
