"""`tiderl launch` and `tiderl status` as a new user first meets them (issue 20), the real
`tiderl` in a subprocess: the progress line in an 80-column terminal (tmux), the job list at 80
columns, and status in a folder with no jobs. Off a terminal (a pipe, a file) the launcher
prints a plain line per step: tests/integration/test_job_control.py reads its running job's."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.running_job import SMALL_JOB
from tests.integration.serving import tiderl_command
from tests.integration.test_cli import tiderl

WIDTH = 80
STEP_LINE = re.compile(r"^step (\d+)/(\d+)  ")


def small_job_args(run_root: Path, steps: int) -> list[str]:
    args = ["launch", "--run-root", str(run_root), "--set", f"job.steps={steps}"]
    for item in SMALL_JOB:
        args += ["--set", item]
    return args


class Terminal:
    """A tmux server of our own with one WIDTH-column pane running ``command``."""

    def __init__(self, command: str, run_for_s: int = 600) -> None:
        tmux = shutil.which("tmux")
        if tmux is None:
            if os.environ.get("CI"):
                pytest.fail("tmux is not installed; CI must install it")
            pytest.skip("tmux is not installed")
        self.base = [tmux, "-L", f"tiderl-cli-{uuid.uuid4().hex[:12]}"]
        self._tmux("new-session", "-d", "-x", str(WIDTH), "-y", "40", "-s", "cli",
                   f"{command}; echo EXIT=$?; sleep {run_for_s}")
        self.socket = Path(self._tmux("display-message", "-p", "#{socket_path}").strip())

    def _tmux(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], check=True, capture_output=True, text=True,
                              timeout=30).stdout

    def lines(self) -> list[str]:
        """The pane's lines, a line the terminal wrapped joined back (-J): what was printed."""
        return self._tmux("capture-pane", "-p", "-J", "-t", "cli").splitlines()

    def wait_exit(self, timeout_s: float) -> list[str]:
        """The pane once its command has exited (EXIT=<code> shows)."""
        deadline = time.monotonic() + timeout_s
        while True:
            lines = self.lines()
            if any(line.startswith("EXIT=") for line in lines):
                return lines
            assert time.monotonic() < deadline, "\n".join(lines)
            time.sleep(0.2)

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)
        self.socket.unlink(missing_ok=True)


def test_the_first_job_at_80_columns_shows_its_step_counter_and_status_the_whole_id(tmp_path):
    run_root = tmp_path / "runs"
    command = shlex.join([*tiderl_command(), *small_job_args(run_root, steps=2)])
    term = Terminal(command)
    try:
        lines = term.wait_exit(timeout_s=300)
    finally:
        term.kill()
    assert "EXIT=0" in lines, "\n".join(lines)
    progress = [line for line in lines if STEP_LINE.match(line)]
    assert progress, "\n".join(lines)  # the line the launcher left: its last redraw
    assert all(len(line) <= WIDTH for line in progress), progress
    assert STEP_LINE.match(progress[-1]).groups() == ("2", "2"), progress

    job = next(path.name for path in run_root.iterdir())
    term = Terminal(shlex.join([*tiderl_command(), "status", "--run-root", str(run_root)]))
    try:
        lines = term.wait_exit(timeout_s=60)
    finally:
        term.kill()
    assert "EXIT=0" in lines, "\n".join(lines)
    row = next((line for line in lines if job in line), None)
    assert row is not None, "\n".join(lines)  # the whole id, never cut
    assert len(row) <= WIDTH and re.search(r"\bdone\b", row), row


def test_status_in_a_folder_without_jobs_says_where_it_looked(tmp_path):
    proc = tiderl("status", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"no jobs in {tmp_path.resolve() / 'runs'}/ (runs/ of this folder; give --run-root DIR "
        "for jobs launched from another one)"]
    assert json.loads(tiderl("status", "--json", cwd=tmp_path).stdout) == []
