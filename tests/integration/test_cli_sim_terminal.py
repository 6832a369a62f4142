"""`tiderl sim` in a real 80-column terminal (tmux): a line per simulation while it runs, and
tables that fit without cutting a number, the paper's figures in a column of their own."""

from __future__ import annotations

import shlex
import subprocess
import time
import uuid

from tests.integration.serving import tiderl_command
from tests.integration.test_top import require_tmux

WIDTH = 80


def run_in_terminal(tmux: str, command: list[str], timeout_s: float = 600.0) -> str:
    """The whole pane (wrapped lines joined back) once ``command`` has exited."""
    base = [tmux, "-L", f"tiderl-sim-{uuid.uuid4().hex[:12]}"]

    def call(*args: str) -> str:
        return subprocess.run([*base, *args], check=True, capture_output=True, text=True,
                              timeout=30).stdout

    call("new-session", "-d", "-x", str(WIDTH), "-y", "50", "-s", "sim",
         f"{shlex.join(command)}; echo EXIT=$?; sleep 600")
    try:
        call("set-option", "-t", "sim", "history-limit", "5000")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = call("capture-pane", "-p", "-J", "-S", "-", "-t", "sim")
            if "EXIT=" in text:
                return text
            time.sleep(0.5)
        raise AssertionError(f"tiderl sim did not finish within {timeout_s:.0f} s:\n{text}")
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True, timeout=30)


def test_sim_shows_progress_and_its_tables_fit_80_columns(tmp_path):
    tmux = require_tmux()
    text = run_in_terminal(tmux, [
        *tiderl_command(), "sim", "sim/cluster32", "--set", "job.steps=2", "--set", "sim.gpus=8",
        "--set", "job.eval_every=0", "--set", "sim.workload=webshop", "--out", str(tmp_path)])
    lines = text.rstrip().splitlines()
    assert "EXIT=0" in lines, text
    tables = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert len(tables) >= 20 and all(len(line.rstrip()) <= WIDTH for line in tables), text
    assert "…" not in text, text
    for n, name in enumerate(("sync", "async", "stream", "tiderl"), start=1):
        assert any(line.startswith(f"simulating policy comparison [{n}/4] {name}, ")
                   and line.endswith(" elapsed") for line in lines), text
    header = next(line for line in lines if "figure" in line and "simulated" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["figure", "simulated", "paper"]
    row = next(line for line in lines if line.startswith("│ tiderl_over_async "))
    assert [c.strip() for c in row.split("│")[1:-1]][2] == "1.8"  # the paper's Fig. 8 figure
    for name in ("sync", "async", "stream", "tiderl"):  # every run's row, every cell filled
        row = next(line for line in lines if line.startswith(f"│ {name} "))
        cells = [c.strip() for c in row.split("│")[1:-1]]
        assert len(cells) == 8 and all(cells), row
