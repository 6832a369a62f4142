"""A real job to break: ``tiderl launch`` as its own process on a small profile, the faults an
operator meets (kill -9, SIGSTOP) sent to its processes by PID, and the checks every chaos test
ends with: the job's groups are each trained once or counted, and no process of it is left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.integration.running_job import SMALL_JOB
from tests.integration.serving import tiderl_command
from tests.waiting import wait_until
from tiderl.launch.local import (
    JOB_FILE,
    JobRecord,
    LaunchError,
    group_members,
    is_running,
    process_state,
    stop_processes,
)
from tiderl.runtime.group_fates import fates_of
from tiderl.runtime.lineage import read_lineage

# A step every few seconds; a checkpoint every 2 steps; a collective a rank died in fails
# after 20 s (then goes out again without it); the watchdog near enough to see
CHAOS_JOB = [*SMALL_JOB, "runtime.checkpoint_every=2", "runtime.collective_timeout_s=20",
             "runtime.watchdog_s=30"]
JOB_TIMEOUT_S = 300.0


@dataclass
class Launch:
    run_root: Path
    proc: subprocess.Popen
    log: Path

    @property
    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def state(self) -> JobRecord:
        """The job's state once every process is started (the launcher says "job <id>: ..."
        then), following the launcher."""
        def started() -> JobRecord | None:
            if "logs in " not in self.output:
                return None
            for path in self.run_root.glob(f"*/{JOB_FILE}"):
                with contextlib.suppress(LaunchError):
                    return JobRecord.load(path.parent)
            return None
        return self.until(started, "every process started")

    def until(self, ready: Callable[[], object], what: str,
              timeout_s: float = JOB_TIMEOUT_S) -> object:
        """Poll ``ready`` until it returns a truthy value; fails as soon as the launcher exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = ready()
            if value:
                return value
            assert self.proc.poll() is None, f"the launcher ended before {what}:\n{self.output}"
            time.sleep(0.2)
        raise AssertionError(f"not {what} within {timeout_s:.0f} s")

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> int:
        return self.proc.wait(timeout_s)


def launch(run_root: Path, *overrides: str, steps: int = 6, resume: str | None = None) -> Launch:
    run_root.mkdir(parents=True, exist_ok=True)
    log = run_root / f"launcher-{time.monotonic_ns()}.log"
    argv = [*tiderl_command(), "launch", "--run-root", str(run_root)]
    if resume is not None:
        argv += ["--resume", resume]
    else:
        argv += ["--set", f"job.steps={steps}"]
        for item in (*CHAOS_JOB, *overrides):
            argv += ["--set", item]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Launch(run_root, proc, log)


@contextlib.contextmanager
def chaos(run_root: Path):
    """Yields a list the test appends its launches to; on exit every launcher and every process
    of the job is stopped, whatever the test did."""
    launches: list[Launch] = []
    try:
        yield launches
    finally:
        for launched in launches:
            if launched.proc.poll() is None:
                os.killpg(launched.proc.pid, signal.SIGKILL)
                launched.proc.wait()
        for path in run_root.glob(f"*/{JOB_FILE}"):
            with contextlib.suppress(LaunchError):
                stop_processes(JobRecord.load(path.parent).processes, grace_s=1.0)


def started(jobs: list[Launch], run_root: Path, *overrides: str, steps: int = 6
            ) -> tuple[Launch, JobRecord, Path]:
    """Launch a job (kept in ``jobs`` for the clean-up); (it, its state once every process is
    started, its run folder)."""
    job = launch(run_root, *overrides, steps=steps)
    jobs.append(job)
    state = job.state()
    return job, state, Path(state.run_dir)


def status_of(run_root: Path, run_dir: Path) -> str:
    """``tiderl status``'s word for the job."""
    return cli_json(run_root, "status", run_dir.name)["state"]


def cli_json(run_root: Path, *args: str) -> dict:
    """What ``tiderl ARGS --run-root RUN_ROOT --json`` prints."""
    out = subprocess.run([*tiderl_command(), *args, "--run-root", str(run_root), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def roles_now(run_dir: Path) -> list[str]:
    """The layout of the last step (ERS moves ranks between steps)."""
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(rows[-1])["roles"]


def rank_log(run_dir: Path, rank: int) -> str:
    log = run_dir / "logs" / f"rank{rank}.log"
    return log.read_text(errors="replace") if log.exists() else ""


def checkpoint_of(run_dir: Path, version: int) -> Path | None:
    """The step folder of ``version`` once the actors completed it (meta.json written)."""
    folder = run_dir / "checkpoints" / f"step-{version:08d}"
    return folder if (folder / "meta.json").exists() and (folder / "job.json").exists() else None


def process(state: JobRecord, name: str):
    return next(p for p in state.processes if p.name == name)


def kill(state: JobRecord, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(process(state, name).pid, sig)


def kill_job(state: JobRecord) -> None:
    """kill -9 of the whole job: its launcher and every process, at once."""
    launcher = state.info.get("launcher_pid")
    for pid in [launcher, *(p.pid for p in state.processes)]:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def events(run_dir: Path, *kinds: str) -> list[dict]:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line a kill cut short
            event = json.loads(line)
            if not kinds or event["kind"] in kinds:
                out.append(event)
    return out


def assert_each_group_once(run_dir: Path) -> dict:
    """From the files' live lineage (what a resume discarded does not count): no group trained
    twice; every group fed is trained, dropped (and counted), or left over at the end (buffered
    or rolling out): none skipped. Returns the last stop event."""
    lineage = read_lineage(run_dir)
    fates = fates_of(lineage.events)
    assert fates.counts, "no stop event"
    assert not fates.problems(), fates.problems()
    return [e for e in lineage.events if e["kind"] == "stop"][-1]


def assert_nothing_left(run_dir: Path) -> None:
    state = JobRecord.load(run_dir)
    for record in state.processes:
        assert not is_running(record.pid), f"{record.name} (pid {record.pid}) still runs"
        assert group_members(record.pid) == [], f"children of {record.name} still run"


KILLED_GONE_S = 10.0  # below the 15 s after which a rank left without its coordinator exits


def wait_nothing_left(run_dir: Path) -> None:
    """assert_nothing_left once every process a kill -9 hit has gone (each goes when it is next
    scheduled, and a loaded machine takes a while): waited for, up to less time than any
    process of the job would take to end by itself."""
    def left() -> list[str]:
        return [f"{r.name} (pid {r.pid}, state {process_state(r.pid)}, group "
                f"{group_members(r.pid)})" for r in JobRecord.load(run_dir).processes
                if is_running(r.pid) or group_members(r.pid)]
    wait_until(lambda: not left(), lambda: f"nothing left: {left()}", timeout_s=KILLED_GONE_S)
    assert_nothing_left(run_dir)
