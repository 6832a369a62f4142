"""A real job for the tests of the commands that act on one (top, rebalance, profile, status,
logs, stop): ``tiderl launch`` as its own process, with a small profile, followed until it has
written its ``job.json`` (and, if asked, its first step), and always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.integration.serving import tiderl_command
from tiderl.launch.local import JOB_FILE, JobRecord, LaunchError, stop_processes

# 3 ranks (1 rollout, 2 actors), short turns: a step every few seconds on 2 cores
SMALL_JOB = [
    "runtime.num_ranks=3", "runtime.rollout_ranks=1", "job.group_size=4",
    "job.batch_min_groups=1", "job.batch_groups=2", "env.max_turns=4", "engine.max_new_tokens=8",
    "engine.kv_cache_tokens=2048", "env.step_latency.median_s=0.02", "runtime.heartbeat_s=0.5",
    "report.plots=false",  # the report's figures: drawn by the jobs of the tests that read them
]


@contextlib.contextmanager
def running_job(run_root: Path, *overrides: str, steps: int = 200, wait_steps: int = 0,
                timeout_s: float = 180.0) -> Iterator[tuple[JobRecord, subprocess.Popen]]:
    """Launch a job under ``run_root``; yields (its JobRecord once every process is started, the
    launcher process) after ``wait_steps`` steps are in metrics.jsonl. On exit the launcher gets
    SIGTERM (it stops the job) and anything left of the job is stopped by PID."""
    run_root.mkdir(parents=True, exist_ok=True)
    log = (run_root / "launcher.log").open("w")
    argv = [*tiderl_command(), "launch", "--run-root", str(run_root),
            "--set", f"job.steps={steps}"]
    for item in (*SMALL_JOB, *overrides):
        argv += ["--set", item]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    state = None
    try:
        state = _wait_started(run_root, proc, timeout_s)
        _wait_steps(Path(state.run_dir), wait_steps, proc, timeout_s)
        yield JobRecord.load(state.run_dir), proc
    finally:
        stop_job(proc, state)
        log.close()


def stop_job(proc: subprocess.Popen, state: JobRecord | None, grace_s: float = 60.0) -> None:
    """SIGTERM to the launcher ``proc`` (it stops the job in order; SIGKILL to its group after
    ``grace_s``), then anything left of the job (``state``: None when it never started) by
    PID."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if state is not None:
        with contextlib.suppress(LaunchError):
            stop_processes(JobRecord.load(state.run_dir).processes, grace_s=2.0)


def _wait_started(run_root: Path, proc: subprocess.Popen, timeout_s: float) -> JobRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (run_root / "launcher.log").read_text()
        for path in run_root.glob(f"*/{JOB_FILE}"):
            with contextlib.suppress(LaunchError):
                state = JobRecord.load(path.parent)
                if any(p.kind == "rank" for p in state.processes):
                    return state
        time.sleep(0.2)
    raise AssertionError(f"the job did not start within {timeout_s:.0f} s")


def _wait_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while steps > 0:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if done >= steps:
            return
        assert proc.poll() is None, f"the job ended before step {steps}"
        assert time.monotonic() < deadline, f"{steps} steps did not finish in {timeout_s:.0f} s"
        time.sleep(0.2)
