"""`tiderl top` in a real terminal (tmux) against a running local job: it shows the ranks with
their roles, refreshes, says "disconnected" while the coordinator is frozen (SIGSTOP) and comes
back when it runs again (SIGCONT), says "job ended" when the job stops, and quits on q with
exit 0. Also `--once --json` and the one-line errors."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.running_job import running_job
from tests.integration.serving import tiderl_command

CONNECTED = re.compile(r"(?<!dis)connected \(last update")
STEP = re.compile(r"step\s+(\d+)/5000")
# the coordinator is frozen for several seconds on purpose: its ranks must not be declared dead
# (and the job stopped) for missed heartbeats when it wakes up
PATIENT_HEARTBEATS = "runtime.heartbeat_misses=60"


def require_tmux() -> str:
    path = shutil.which("tmux")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("tmux is not installed; CI must install it (see the CI workflow)")
        pytest.skip("tmux is not installed")
    return path


class Pane:
    """One tmux server of our own (``-L name``), one session, one pane."""

    def __init__(self, tmux: str, command: str) -> None:
        self.base = [tmux, "-L", f"tiderl-top-{uuid.uuid4().hex[:12]}"]
        self._tmux("new-session", "-d", "-x", "200", "-y", "50", "-s", "top",
                   f"{command}; echo EXIT=$?; sleep 30")
        self.socket = Path(self._tmux("display-message", "-p", "#{socket_path}").strip())

    def _tmux(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], check=True, capture_output=True, text=True,
                              timeout=30).stdout

    def capture(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "top")

    def send_keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def wait_for(self, is_done: Callable[[str], object], what: str,
                 timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.capture()
            if is_done(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"the pane did not show {what} within {timeout_s:.0f} s:\n{text}")

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)
        self.socket.unlink(missing_ok=True)  # kill-server can leave it behind


def status_line(text: str) -> str:
    return next((line for line in text.splitlines() if "status" in line), "")


def tiderl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*tiderl_command(), *args], capture_output=True, text=True,
                          timeout=120)


def test_no_running_job_is_one_line(tmp_path):
    proc = tiderl("top", "--run-root", str(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr == f"error: tiderl top: no running job in {tmp_path}/ (give a job id, " \
                          "or --bus and --keys)\n"
    proc = tiderl("top", "--bus", "tcp://127.0.0.1:1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--bus needs --keys" in proc.stderr


def test_top_follows_a_job_through_a_frozen_coordinator_and_quits_on_q(tmp_path):
    tmux = require_tmux()
    run_root = tmp_path / "runs"
    with running_job(run_root, PATIENT_HEARTBEATS, steps=5000, wait_steps=1) as (state, launcher):
        coordinator = next(p.pid for p in state.processes if p.kind == "coordinator")
        once = tiderl("top", "--once", "--json", "--run-root", str(run_root))  # the newest job
        assert once.returncode == 0, once.stderr
        payload = json.loads(once.stdout)
        assert payload["job"] == state.job_id and payload["endpoint"] == state.info["pub"]
        assert len(payload["snapshot"]["roles"]) == 3

        command = shlex.join([*tiderl_command(), "top", state.job_id,
                              "--run-root", str(run_root)])
        pane = Pane(tmux, command)
        try:
            first = pane.wait_for(lambda t: CONNECTED.search(t) and STEP.search(t)
                                  and re.search(r"^ +\d +rollout ", t, re.M)
                                  and re.search(r"^ +\d +actor ", t, re.M), "the ranks and a step")
            assert state.job_id in first
            pane.wait_for(lambda t: status_line(t) != status_line(first), "a refresh",
                          timeout_s=10)

            os.kill(coordinator, signal.SIGSTOP)
            try:
                frozen = pane.wait_for(lambda t: "disconnected (no snapshot for" in t,
                                       "disconnected", timeout_s=30)
                assert "reconnecting" in frozen
            finally:
                os.kill(coordinator, signal.SIGCONT)
            back = pane.wait_for(lambda t: CONNECTED.search(t), "connected again", timeout_s=30)
            assert "disconnected" not in back and "job ended" not in back

            os.kill(launcher.pid, signal.SIGTERM)  # the launcher stops the whole job
            ended = pane.wait_for(lambda t: "job ended" in t, "job ended", timeout_s=60)
            assert re.search(r"^ +\d +(rollout|actor|ref) ", ended, re.M)  # the last view stays

            pane.send_keys("q")
            done = pane.wait_for(lambda t: "EXIT=" in t, "top exiting", timeout_s=30)
            assert "EXIT=0" in done, done
            assert "Traceback" not in done
        finally:
            pane.kill()
