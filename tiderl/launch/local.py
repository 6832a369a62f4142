"""The local executor: start a job's processes on this machine, record them, stop them.

Each process runs in its own session (``start_new_session``), so a Ctrl-C in the launcher's
terminal reaches only the launcher, which then stops the job in order. A process's own children
share its process group and are stopped with it (``killpg``): nothing is orphaned. Its stdout and
stderr go to ``runs/<job>/logs/<name>.log``; PIDs and log paths are recorded in ``job.json``,
which ``tiderl status | logs | stop`` read.

Liveness reads the process state from ``/proc``: a killed process that is not reaped yet (its
parent is gone and PID 1 reaps late, or we have not waited yet) is a zombie, which ``kill -0``
would still call alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiderl.launch.plan import LaunchPlan, ProcessSpec

JOB_FILE = "job.json"
COORDINATOR_GRACE_S = 30.0  # SIGTERM to SIGKILL for the coordinator: its stop event, its report
INTERRUPT_GRACE_S = 15.0  # after Ctrl-C, for the coordinator to end the job as interrupted


class LaunchError(RuntimeError):
    """A process could not be started; the message names it. Nothing of the job is left running."""


class LaunchRefused(LaunchError):
    """The job cannot run as asked (a profile value this machine cannot serve, a job that
    cannot resume); found before anything is made or started."""


@dataclass(frozen=True)
class ProcessCommand:
    name: str
    kind: str  # "env" | "coordinator" | "rank"
    argv: tuple[str, ...]
    rank: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment


@dataclass
class ProcessRecord:
    name: str
    kind: str
    pid: int
    log: str
    argv: list[str]
    rank: int | None = None
    host: str = "localhost"

    @property
    def run_dir(self) -> str:
        """The run folder on its node: its log sits in ``<run_dir>/logs/``."""
        return self.log.rsplit("/logs/", 1)[0]


@dataclass
class JobRecord:
    """A launched job as ``job.json`` holds it: its processes (node, PID, log) as they start,
    and ``info``, what the CLI needs to reach it (:func:`tiderl.launch.job.job_info`)."""

    job_id: str
    run_dir: str
    created: float
    processes: list[ProcessRecord] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # bus endpoints, profile path, ...

    def save(self) -> None:
        path = Path(self.run_dir) / JOB_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, run_dir: str | Path) -> JobRecord:
        path = Path(run_dir) / JOB_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise LaunchError(f"{path}: no such job") from None
        except (OSError, ValueError) as exc:
            raise LaunchError(f"{path}: unreadable ({exc})") from None
        processes = [ProcessRecord(**p) for p in data.pop("processes")]
        return cls(processes=processes, **data)


def process_state(pid: int) -> str | None:
    """The one-letter state from ``/proc/PID/stat`` (R, S, D, Z, ...), or None if there is no
    such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat_state(stat)


def stat_state(stat: str) -> str:
    """The state letter of a ``/proc/PID/stat`` line."""
    return stat.rsplit(")", 1)[1].split()[0]  # the name field may hold spaces and parentheses


def alive(letter: str | None) -> bool:
    """Whether a process in this state letter runs (None: there is no such process; a zombie
    has ended, it is only not reaped yet)."""
    return letter is not None and letter not in ("Z", "X")


def is_running(pid: int) -> bool:
    return alive(process_state(pid))


class LocalExecutor:
    """Starts processes and keeps their ``Popen`` handles, so it can reap its own children.
    Its job's run folder is on this machine: nothing to push, nothing to fetch."""

    def __init__(self, job: JobRecord):
        self.job = job
        self.popens: dict[int, subprocess.Popen] = {}

    def push(self, plan: LaunchPlan) -> None:
        """The daemons read the run folder where the launcher made it."""

    def start(self, commands: Sequence[ProcessCommand | ProcessSpec],
              cwd: str | Path | None = None) -> None:
        """Start every command in order; if one fails to start, stop those already started and
        raise ``LaunchError`` naming it."""
        logs = Path(self.job.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for command in commands:
            log_path = logs / f"{command.name}.log"
            try:
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(
                        list(command.argv), stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                        env={**os.environ, **command.env})
            except OSError as exc:
                self.stop(grace_s=2.0)
                raise LaunchError(f"{command.name}: could not start {command.argv[0]!r} "
                                  f"({exc.strerror or exc})") from None
            self.popens[proc.pid] = proc
            self.job.processes.append(ProcessRecord(
                name=command.name, kind=command.kind, pid=proc.pid, log=str(log_path),
                argv=list(command.argv), rank=command.rank))
            self.job.save()

    def exited(self) -> list[tuple[ProcessRecord, int]]:
        """The job's processes that have ended, with their exit codes."""
        ended = []
        for record in self.job.processes:
            proc = self.popens.get(record.pid)
            if proc is not None and proc.poll() is not None:
                ended.append((record, proc.returncode))
        return ended

    def kill(self, record: ProcessRecord) -> None:
        """SIGKILL one process (and its group)."""
        _signal_group(record.pid, signal.SIGKILL)

    def interrupt(self, grace_s: float = INTERRUPT_GRACE_S) -> None:
        """Ctrl-C reaches the launcher only (every daemon has its own session): pass it on to
        the coordinator, which ends the job as interrupted and writes its report, before the
        rest is stopped."""
        coordinator = next((r for r in self.job.processes if r.kind == "coordinator"), None)
        if coordinator is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(coordinator.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if any(r.pid == coordinator.pid for r, _ in self.exited()):
                return
            time.sleep(0.1)

    def stop(self, grace_s: float = 10.0) -> dict[str, str]:
        """Stop every process (last started first); see ``stop_processes``."""
        return stop_processes(self.job.processes, grace_s, self.popens)

    def shut_down(self, grace_s: float) -> None:
        """At the job's end: stop whatever is left."""
        self.stop(grace_s)


def stop_processes(records: Sequence[ProcessRecord], grace_s: float = 10.0,
                   popens: dict[int, subprocess.Popen] | None = None) -> dict[str, str]:
    """Stop a job's processes: the coordinator first (given at least ``COORDINATOR_GRACE_S`` to
    record how the job ended and write its report; on a loaded machine that takes seconds),
    then the others together (see :func:`stop_together`)."""
    first, rest = split_coordinator(records)
    outcome = stop_together(first, max(grace_s, COORDINATOR_GRACE_S), popens)
    outcome.update(stop_together(rest, grace_s, popens))
    return outcome


def split_coordinator(records: Sequence[ProcessRecord]
                      ) -> tuple[list[ProcessRecord], list[ProcessRecord]]:
    """(the coordinator's record, if any; the others), in the order given."""
    return ([r for r in records if r.kind == "coordinator"],
            [r for r in records if r.kind != "coordinator"])


def stop_together(records: Sequence[ProcessRecord], grace_s: float = 10.0,
                  popens: dict[int, subprocess.Popen] | None = None) -> dict[str, str]:
    """SIGTERM each process group, wait up to ``grace_s`` for all of them to end, then SIGKILL
    the rest; finally SIGKILL any member of their groups still running (a child that ignored
    SIGTERM after its parent ended). Returns how each ended: "terminated", "killed" or "gone"
    (not running when we came). Children of ours are reaped; others are read from /proc."""
    popens = popens or {}
    outcome: dict[str, str] = {}
    pending = []
    for record in reversed(records):
        if not _alive(record.pid, popens):
            outcome[record.name] = "gone"
            continue
        _signal_group(record.pid, signal.SIGTERM)
        pending.append(record)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        still = []
        for record in pending:
            if _alive(record.pid, popens):
                still.append(record)
            else:
                outcome[record.name] = "terminated"
        pending = still
        if pending:
            time.sleep(0.05)
    for record in pending:
        _signal_group(record.pid, signal.SIGKILL)
        outcome[record.name] = "killed"
    for record in pending:  # a SIGKILL ends it; reap our own children
        proc = popens.get(record.pid)
        if proc is not None:
            proc.wait(timeout=5)
    for record in records:
        if group_members(record.pid):
            _signal_group(record.pid, signal.SIGKILL)
    _wait_killed(records, popens)
    return outcome


def _wait_killed(records: Sequence[ProcessRecord], popens: dict[int, subprocess.Popen],
                 timeout_s: float = 10.0) -> None:
    """Until every process of the records' groups has ended: a SIGKILLed process is not gone
    until the kernel has torn it down (a moment; longer in uninterruptible sleep), and whoever
    called stop expects none of them left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(r.pid, popens) or group_members(r.pid) for r in records):
            return
        time.sleep(0.05)


def records_by_host(records: Sequence[ProcessRecord]) -> dict[str, list[ProcessRecord]]:
    """A job's process records grouped by node, in start order."""
    hosts: dict[str, list[ProcessRecord]] = {}
    for record in records:
        hosts.setdefault(record.host, []).append(record)
    return hosts


def group_members(pgid: int) -> list[int]:
    """Running processes (not zombies) whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _alive(pid: int, popens: dict[int, subprocess.Popen]) -> bool:
    proc = popens.get(pid)
    if proc is not None:
        return proc.poll() is None
    return is_running(pid)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # each process leads its own session and group
