"""Job control on a launched job, local, over SSH or in a Slurm allocation: its status, process
states, stopping, logs.

What ``tiderl status | logs | stop | top`` do, from ``runs/<job>/job.json``: each process record
names its node (``localhost`` for a local job; a node of ``info["nodes"]`` for an SSH job) and its
PID; the PID leads the process's own group. A Slurm job's processes run in its job steps
(``info["slurm"]``): their states are their steps' (``squeue``), stopping one cancels its steps,
and its logs are read where the launcher's run folder is (the nodes share it). States come from
``/proc`` (a zombie is not alive); a job is alive while any of its processes is
(:func:`is_job_alive`). A job's state word
(:func:`job_status`):

    every process running                      running
    some running                               partial
    an SSH job whose nodes do not answer       unreachable
    none running: its last stop event's state  done | failed | stopped | interrupted
                  no stop event                crashed (its coordinator was killed)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tiderl.core.quote import short
from tiderl.launch.local import (
    COORDINATOR_GRACE_S,
    JobRecord,
    LaunchError,
    ProcessRecord,
    alive,
    is_running,
    process_state,
    records_by_host,
    stop_processes,
)
from tiderl.launch.run_folders import job_file, last_stop_in
from tiderl.launch.slurm import cancel_steps, is_slurm, step_states
from tiderl.launch.ssh import NodeSession, job_node, open_sessions
from tiderl.runtime.lineage import EVENTS_FILE, METRICS_FILE, ReportError, read_lineage

# a launcher stops its job in order: the coordinator's grace, the others', and more
LAUNCHER_EXIT_S = COORDINATOR_GRACE_S + 30.0
# a stop event's state -> how the job ended ("ok": a job that stopped at its last step)
ENDED = {"ok": "done", "failed": "failed", "stopped": "stopped", "interrupted": "interrupted"}


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands (:func:`job_status`)."""

    state: str  # running, partial, unreachable, or how it ended (the module docstring)
    steps_done: int  # step records of its live lineage (what a resume discarded is not)
    steps_total: int | None  # job.steps (None: job.json does not say)
    num_running: int
    num_processes: int
    where: str  # "local", or its nodes
    process_states: dict[str, str | None]  # name -> state letter (None: gone); {} unreachable


def job_status(job: JobRecord, strict: bool = False) -> JobStatus:
    """The job's status, over one set of SSH sessions for an SSH job. Nodes that do not answer:
    LaunchError when ``strict``, else the state "unreachable" (with the steps of the copy the
    launcher fetched at the job's end)."""
    try:
        with sessions(job) as nodes:
            states = process_states(job, nodes)
            steps, ended = _steps_done(job, nodes), _ended(job, nodes)
    except LaunchError:
        if strict:
            raise
        states, steps, ended = {}, _steps_done(job, None), _ended(job, None)
    running, total = sum(map(alive, states.values())), len(job.processes)
    if not states and is_remote(job):
        word = "unreachable"
    else:
        word = "running" if running == total and total else ended if not running else "partial"
    return JobStatus(word, steps, job.info.get("steps"), running, total, _where(job), states)


def _where(job: JobRecord) -> str:
    if is_slurm(job):
        slurm = job.info["slurm"]
        return f"Slurm job {slurm['job_id']}: {', '.join(slurm['nodes'])}"
    return ", ".join(job.info["nodes"]) if is_remote(job) else "local"


def _steps_done(job: JobRecord, nodes: dict[str, NodeSession] | None) -> int:
    """Steps done: the step records of the job's live lineage (its metrics.jsonl and
    events.jsonl, fetched from an SSH job's node); 0 while it has none, or a line of them
    cannot be read."""
    try:
        for name in (METRICS_FILE, EVENTS_FILE):
            job_file(job, name, nodes)
        return len(read_lineage(Path(job.run_dir)).metrics)
    except (LaunchError, ReportError):
        return 0


def _ended(job: JobRecord, nodes: dict[str, NodeSession] | None) -> str:
    """How a job that runs no more ended, from the last ``stop`` event of its live lineage
    (see ENDED); crashed when it has none."""
    try:
        stop = last_stop_in(job_file(job, EVENTS_FILE, nodes).read_text())
    except (LaunchError, OSError):
        stop = {}
    return ENDED.get(stop.get("state", "ok" if stop.get("reason") == "done" else ""),
                     "crashed")


def is_remote(job: JobRecord) -> bool:
    return bool(job.info.get("nodes"))


@contextlib.contextmanager
def sessions(job: JobRecord) -> Iterator[dict[str, NodeSession]]:
    """Open SSH sessions to the nodes of an SSH job (none for a local job)."""
    if not is_remote(job):
        yield {}
        return
    opened = open_sessions([job_node(job.info, name) for name in job.info["nodes"]])
    try:
        yield opened
    finally:
        for session in opened.values():
            session.close()


def process_states(job: JobRecord, nodes: dict[str, NodeSession]) -> dict[str, str | None]:
    """Each process's state letter (R, S, D, Z, ...), None when there is no such process; in a
    Slurm allocation, its job step's (R while Slurm runs it)."""
    if is_slurm(job):
        return step_states(job)
    if not is_remote(job):
        return {r.name: process_state(r.pid) for r in job.processes}
    states: dict[str, str | None] = {}
    for host, records in records_by_host(job.processes).items():
        found = nodes[host].states([r.pid for r in records])
        states.update({r.name: found[r.pid] for r in records})
    return states


def is_job_alive(job: JobRecord, nodes: dict[str, NodeSession] | None = None) -> bool | None:
    """Whether any process of the job still runs: from ``/proc`` for a local job, on its nodes
    for an SSH job (over ``nodes`` when the sessions are open, else over new ones). None when
    the nodes of an SSH job do not answer new sessions: nobody can tell."""
    if nodes is None:
        try:
            with sessions(job) as opened:
                return is_job_alive(job, opened)
        except LaunchError:
            return None
    return any(map(alive, process_states(job, nodes).values()))


def stop_job(job: JobRecord, grace_s: float = 10.0) -> tuple[bool, dict[str, str]]:
    """Stop every process of the job on every node. Its launcher, when it still runs, gets
    SIGTERM first (it stops the job in order and fetches an SSH job's results); then any
    process left gets SIGTERM and, after ``grace_s``, SIGKILL. Returns (whether the launcher
    was stopped, how each process ended: "terminated", "killed" or "gone" when it was not
    running any more). Raises ``LaunchError`` if a process still runs afterwards."""
    launcher = _stop_launcher(job.info.get("launcher_pid"), grace_s)
    with sessions(job) as nodes:
        if is_slurm(job):
            outcome = cancel_steps(job, grace_s)
        elif is_remote(job):
            from tiderl.launch.remote import fetch_results, stop_on_nodes

            outcome = stop_on_nodes(job, nodes, grace_s)
            fetch_results(job, nodes)
        else:
            outcome = stop_processes(job.processes, grace_s)
        after = process_states(job, nodes)
    left = [name for name, letter in after.items() if alive(letter)]
    if left:
        raise LaunchError(f"job {job.job_id}: still running after SIGKILL: {', '.join(left)}")
    return launcher, outcome


def _stop_launcher(pid: int | None, grace_s: float) -> bool:
    """SIGTERM the job's launcher (``tiderl launch``) and wait for it; False if it was gone."""
    if not pid or not is_running(pid) or not _is_launcher(pid):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + LAUNCHER_EXIT_S
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return True


def _is_launcher(pid: int) -> bool:
    """Guards against a recycled PID: the process must be a ``tiderl launch``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"launch" in argv and any(b"tiderl" in a for a in argv)


def read_log(record: ProcessRecord, nodes: dict[str, NodeSession], offset: int = 0,
             fallback: Path | None = None) -> bytes | None:
    """A process's log from ``offset`` on: from its node, or the launcher's fetched copy
    (``fallback``) when the node no longer has it; None when neither exists."""
    if record.host in nodes:
        data = nodes[record.host].read(record.log, offset)
        if data is not None:
            return data
        path = fallback
    else:
        path = Path(record.log)
    if path is None or not path.exists():
        return None
    with path.open("rb") as handle:
        handle.seek(offset)
        return handle.read()


def select(job: JobRecord, rank: int | None = None,
           process: str | None = None) -> list[ProcessRecord]:
    """The job's processes, or the one of ``rank`` / named ``process``."""
    if rank is None and process is None:
        return list(job.processes)
    chosen = [r for r in job.processes
              if (rank is not None and r.rank == rank) or (process is not None
                                                           and r.name == process)]
    if not chosen:
        names = ", ".join(r.name for r in job.processes) or "none"
        what = f"rank {rank}" if rank is not None else f"process {short(process)}"
        raise LaunchError(f"job {job.job_id} has no {what} (processes: {names})")
    return chosen

