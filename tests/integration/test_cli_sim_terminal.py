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
    # the four systems, then async at the profile's fixed splits but its own (0.25: async's run)
    runs = ("sync", "async", "stream", "tiderl", "async 0.3125", "async 0.375", "async 0.4375",
            "async 0.5")
    for n, name in enumerate(runs, start=1):
        assert any(line.startswith(f"simulating policy comparison [{n}/8] {name}, ")
                   and line.endswith(" elapsed") for line in lines), text
    header = next(line for line in lines if "figure" in line and "simulated" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["figure", "simulated", "paper"]
    row = next(line for line in lines if line.startswith("│ tiderl_over_async "))
    assert [c.strip() for c in row.split("│")[1:-1]][2] == "1.8"  # the paper's Fig. 8 figure
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines
            if line.startswith("│ ") and line.count("│") > 2]
    for name in (*runs, "async 0.25"):  # every run's row, every cell filled: its 10 columns
        # (the run, then 9 figures) over the comparison table and its continuation
        parts = [cells for cells in rows if cells[0] == name and len(cells) > 3]
        assert sum(len(cells) - 1 for cells in parts[:2]) == 9, parts
        assert all(all(cells) for cells in parts[:2]), parts
