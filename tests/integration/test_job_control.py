"""`tiderl status | logs | stop` on a real local job (a job killed under its ranks: tests/chaos)."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

from tests.integration.running_job import running_job
from tests.integration.serving import tiderl_command
from tests.integration.test_cli import assert_one_line_error, tiderl
from tiderl.launch.local import JobState, group_members, is_running


def test_status_logs_and_stop_on_a_local_job(tmp_path):
    run_root = tmp_path / "runs"
    with running_job(run_root, wait_steps=1) as (state, launcher):
        job = state.job_id
        listing = json.loads(tiderl("status", "--run-root", str(run_root), "--json").stdout)
        assert [(j["job"], j["where"], j["state"]) for j in listing] == [(job, "local",
                                                                           "running")]
        detail = json.loads(tiderl("status", job, "--run-root", str(run_root), "--json").stdout)
        assert [p["name"] for p in detail["processes"]] == ["env", "coordinator", "rank0",
                                                            "rank1", "rank2"]
        assert all(p["state"].startswith("running") for p in detail["processes"])
        coordinator = tiderl("logs", job, "--process", "coordinator", "--run-root",
                             str(run_root))
        assert coordinator.returncode == 0 and "rank 2 up" in coordinator.stdout
        # -f follows until the job ends: stop it from the side
        follow = subprocess.Popen([*tiderl_command(), "logs", job, "--rank", "0", "-f",
                                   "--run-root", str(run_root)], stdout=subprocess.PIPE,
                                  text=True)
        stopped = {}
        stopper = threading.Timer(3.0, lambda: stopped.update(proc=tiderl(
            "stop", job, "--run-root", str(run_root), "--json")))
        stopper.start()
        out, _ = follow.communicate(timeout=120)
        stopper.join()
        assert follow.returncode == 0 and " rank0 " in out
        stop = stopped["proc"]
        assert stop.returncode == 0, stop.stderr
        assert json.loads(stop.stdout)["launcher_stopped"] is True
        assert launcher.wait(30) == 143  # SIGTERM: it stopped the job and said so
        for record in JobState.load(state.run_dir).processes:
            assert not is_running(record.pid) and group_members(record.pid) == []
        ended = json.loads(tiderl("status", job, "--run-root", str(run_root), "--json").stdout)
        coordinator_log = Path(state.run_dir, "logs", "coordinator.log").read_text()
        assert ended["state"] == "stopped", coordinator_log[-3000:]  # by `tiderl stop`
        assert "report: " in coordinator_log  # written before the rest of the job was stopped
    assert_one_line_error(tiderl("status", "nope", "--run-root", str(run_root)), 1)
    assert_one_line_error(tiderl("stop", "nope", "--run-root", str(run_root)), 1)
