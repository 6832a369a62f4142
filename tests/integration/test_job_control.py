"""The commands that act on a running local job, on one real job started for this module:
`tiderl status | logs | top | profile | stop`, the coordinator's /metrics and the launcher's
own progress lines (a job killed under its ranks: tests/chaos). The tests read the job in turn;
the last one follows it with `top` (in a real terminal, through a frozen coordinator) and
`logs -f` until `tiderl stop` ends it."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.running_job import running_job
from tests.integration.serving import tiderl_command
from tests.integration.test_cli import assert_one_line_error, tiderl
from tests.integration.test_cli_progress_status import STEP_LINE
from tests.integration.test_monitoring import TEN, measure_kv_json
from tests.integration.test_top import CONNECTED, STEP, Pane, require_tmux, status_line
from tiderl.launch.local import JobRecord, group_members, is_running

# the coordinator is frozen for several seconds on purpose: its ranks must not be declared dead
# (and the job stopped) for missed heartbeats when it wakes up
PATIENT_HEARTBEATS = "runtime.heartbeat_misses=60"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    run_root = tmp_path_factory.mktemp("job") / "runs"
    with running_job(run_root, PATIENT_HEARTBEATS, steps=5000, wait_steps=2) as (state,
                                                                                 launcher):
        yield state, launcher, run_root


def _running(job) -> tuple[JobRecord, subprocess.Popen, Path]:
    state, launcher, run_root = job
    assert launcher.poll() is None, "the job has ended (the test that stops it runs last)"
    return state, launcher, run_root


def test_status_and_logs_read_the_running_job(job):
    state, _launcher, run_root = _running(job)
    root = ("--run-root", str(run_root))
    listing = json.loads(tiderl("status", *root, "--json").stdout)
    assert [(j["job"], j["where"], j["state"]) for j in listing] == [(state.job_id, "local",
                                                                       "running")]
    detail = json.loads(tiderl("status", state.job_id, *root, "--json").stdout)
    assert [p["name"] for p in detail["processes"]] == ["env", "coordinator", "rank0", "rank1",
                                                        "rank2"]
    assert all(p["state"].startswith("running") for p in detail["processes"])
    coordinator = tiderl("logs", state.job_id, "--process", "coordinator", *root)
    assert coordinator.returncode == 0 and "rank 2 up" in coordinator.stdout


def test_off_a_terminal_the_launcher_prints_one_plain_line_per_step_as_it_goes(job):
    """Its output goes to a file here (running_job), which is to it what a pipe is: not a
    terminal. Read while the job runs: a line per step, no redraws, no colour codes."""
    _state, launcher, run_root = _running(job)
    log = run_root / "launcher.log"
    deadline = time.monotonic() + 120
    while not any(_step(line) == 2 for line in log.read_text().splitlines()):
        assert launcher.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    lines = log.read_text().splitlines()
    steps = [_step(line) for line in lines if _step(line) is not None]
    assert steps[:2] == [1, 2] and steps == sorted(set(steps)), lines  # one line per step
    assert not any("\r" in line or "\x1b" in line for line in lines), lines
    assert all(line.count("step ") == 1 for line in lines if _step(line) is not None)


def _step(line: str) -> int | None:
    match = STEP_LINE.match(line)
    return int(match.group(1)) if match else None


def test_top_once_shows_the_newest_job(job):
    state, _launcher, run_root = _running(job)
    once = tiderl("top", "--once", "--json", "--run-root", str(run_root))  # the newest job
    assert once.returncode == 0, once.stderr
    payload = json.loads(once.stdout)
    assert payload["job"] == state.job_id and payload["endpoint"] == state.info["pub"]
    assert len(payload["snapshot"]["roles"]) == 3


def test_the_coordinator_serves_its_metrics(job):
    state, _launcher, _run_root = _running(job)
    text = httpx.get(state.info["metrics"], timeout=5).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    names = {name for name, _ in samples}
    assert set(TEN) <= names, set(TEN) - names
    assert samples[("tiderl_trained_tokens_total", ())] > 0
    assert samples[("tiderl_goodput_tokens_total", ())] == samples[
        ("tiderl_trained_tokens_total", ())]
    ranks = {dict(labels)["role"]: v for (name, labels), v in samples.items()
             if name == "tiderl_ranks"}
    assert set(ranks) == {"rollout", "ref", "actor", "idle"}
    assert sum(ranks.values()) == 3
    modes = [v for (name, _), v in samples.items() if name == "tiderl_step_mode"]
    assert sorted(modes) == [0, 0, 0, 0, 1]  # one series per step mode, the last step's 1


def test_measure_kv_of_the_job(job):
    state, _launcher, run_root = _running(job)
    data = measure_kv_json("--job", state.job_id, "--run-root", str(run_root), "--duration",
                           "2", "--interval", "0.5")
    assert data["source"] == "tiderl coordinator"
    assert data["url"] == state.info["metrics"]
    assert len(data["samples"]) == 4
    assert all(0.0 <= s["usage"] <= 1.0 and s["capacity_tokens"] > 0 for s in data["samples"])
    assert {s["hit_rate_kind"] for s in data["samples"]} == {"gauge"}


def test_measure_readiness_of_the_job(job):
    state, _launcher, run_root = _running(job)
    root = ("--run-root", str(run_root))
    proc = tiderl("measure", "readiness", "--job", state.job_id, *root)
    assert proc.returncode == 0, proc.stderr
    assert "RAS" in proc.stdout and "TPRM s" in proc.stdout and "micro-batches" in proc.stdout
    png = f"{state.run_dir}/readiness.png"
    assert f"plot: {png}" in proc.stdout.replace("\n", "")
    data = json.loads(tiderl("measure", "readiness", "--job", state.job_id, *root,
                             "--json").stdout)
    assert len(data["steps"]) >= 2
    assert set(data["steps"][0]) == {"step", "ras", "tprm_s", "step_mode", "num_micro_batches",
                                     "step_s"}
    assert data["png"] == png
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_top_and_logs_follow_the_job_through_a_frozen_coordinator_until_stop_ends_it(job):
    """`top` in tmux shows the ranks and refreshes, says "disconnected" while the coordinator is
    frozen (SIGSTOP) and comes back when it runs again (SIGCONT); `logs -f` follows rank 0;
    `tiderl stop` stops the job through its launcher: `logs -f` ends, `top` says "job ended"
    and quits on q with exit 0, and nothing of the job is left."""
    tmux = require_tmux()
    state, launcher, run_root = _running(job)
    job_id, root = state.job_id, ("--run-root", str(run_root))
    coordinator = next(p.pid for p in state.processes if p.kind == "coordinator")
    pane = Pane(tmux, shlex.join([*tiderl_command(), "top", job_id, *root]))
    # -f follows until the job ends; it starts beside top (each a new `tiderl` process)
    follow = subprocess.Popen([*tiderl_command(), "logs", job_id, "--rank", "0", "-f", *root],
                              stdout=subprocess.PIPE, text=True)
    try:
        first = pane.wait_for(lambda t: CONNECTED.search(t) and STEP.search(t)
                              and re.search(r"^ +\d +rollout ", t, re.M)
                              and re.search(r"^ +\d +actor ", t, re.M), "the ranks and a step")
        assert job_id in first
        pane.wait_for(lambda t: status_line(t) != status_line(first), "a refresh", timeout_s=10)

        os.kill(coordinator, signal.SIGSTOP)
        try:
            frozen = pane.wait_for(lambda t: "disconnected (no snapshot for" in t,
                                   "disconnected", timeout_s=30)
            assert "reconnecting" in frozen
        finally:
            os.kill(coordinator, signal.SIGCONT)
        back = pane.wait_for(lambda t: CONNECTED.search(t), "connected again", timeout_s=30)
        assert "disconnected" not in back and "job ended" not in back

        # once -f has printed, stop the job from the side: -f ends with it
        first_line = follow.stdout.readline()  # "" only if it ended without a line
        stopped = {}
        stopper = threading.Thread(target=lambda: stopped.update(proc=tiderl(
            "stop", job_id, *root, "--json")))
        stopper.start()
        out, _ = follow.communicate(timeout=120)
        stopper.join()
        assert follow.returncode == 0 and " rank0 " in first_line + out
        stop = stopped["proc"]
        assert stop.returncode == 0, stop.stderr
        assert json.loads(stop.stdout)["launcher_stopped"] is True
        assert launcher.wait(30) == 143  # SIGTERM: it stopped the job and said so
        for record in JobRecord.load(state.run_dir).processes:
            assert not is_running(record.pid) and group_members(record.pid) == []

        ended = pane.wait_for(lambda t: "job ended" in t, "job ended", timeout_s=60)
        assert re.search(r"^ +\d +(rollout|actor|ref) ", ended, re.M)  # the last view stays
        pane.send_keys("q")
        done = pane.wait_for(lambda t: "EXIT=" in t, "top exiting", timeout_s=30)
        assert "EXIT=0" in done, done
        assert "Traceback" not in done
    finally:
        pane.kill()
        if follow.poll() is None:
            follow.kill()
        follow.wait()
    with ThreadPoolExecutor(3) as pool:  # three `tiderl` processes: at once
        status, status_nope, stop_nope = pool.map(lambda args: tiderl(*args), [
            ("status", job_id, *root, "--json"), ("status", "nope", *root),
            ("stop", "nope", *root)])
    ended = json.loads(status.stdout)
    coordinator_log = Path(state.run_dir, "logs", "coordinator.log").read_text()
    assert ended["state"] == "stopped", coordinator_log[-3000:]  # by `tiderl stop`
    assert "report: " in coordinator_log  # written before the rest of the job was stopped
    assert_one_line_error(status_nope, 1)
    assert_one_line_error(stop_nope, 1)
