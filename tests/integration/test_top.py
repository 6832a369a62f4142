"""`tiderl top`'s one-line errors, and the tmux pane the tests of `top` in a real terminal use
(`top` against a running job, through a frozen coordinator to the job's end:
tests/integration/test_job_control.py, which shares one job among the commands that act on
one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.serving import tiderl_command

CONNECTED = re.compile(r"(?<!dis)connected \(last update")
STEP = re.compile(r"step\s+(\d+)/5000")


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
