"""`tiderl top`: a live terminal view of a running job, fed by the coordinator's PUB socket.

::

    coordinator PUB ──Snapshot every 0.5 s and after each step──> Subscriber (CurveZMQ SUB)
                                                                      │ recv(TICK_S), drained
    stdin (cbreak, TTY only) ──q / Q──> quit                          v
    job.json + /proc (SSH job: its nodes) ──> "job ended"    TopState.fold(snap, now)
                                                                      │ every REDRAW_S and
                                                                      v on each snapshot
                                                          rich Live <── render(state, now)

ZeroMQ reconnects a SUB by itself; a bus silent for RECONNECT_S is also reopened (a fresh TCP
connection and handshake, and the PUB address read again from job.json), which covers a
half-open connection to a vanished host. The view is a pure function of the state
(:mod:`tiderl.cli.top_view`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import time
import tty
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.options import seconds_option
from tiderl.cli.output import JsonFlag, Output

if TYPE_CHECKING:  # imported where used: `tiderl --help` loads no ZeroMQ or SSH client
    from tiderl.launch.local import JobRecord
    from tiderl.runtime.bus import JobKeys, Snapshot, Subscriber

TICK_S = 0.1  # longest wait on the bus: the latency of a key press
REDRAW_S = 0.25  # the view is redrawn at least 4 times a second
LIVENESS_S = 1.0  # how often the job's processes are looked at
RECONNECT_S = 5.0  # a bus silent this long is reopened, and again every RECONNECT_S


@dataclass(frozen=True)
class Target:
    """What top watches: a PUB endpoint, the keys to join it and, when known, the job."""

    label: str
    endpoint: str
    keys: JobKeys
    job: JobRecord | None  # None: a raw --bus endpoint, liveness unknown


def top(
    job: str | None = typer.Argument(
        None, help="Job id in the run root, or a run folder; omit for the newest running job."),
    run_root: Path | None = typer.Option(None, "--run-root",
                                         help="Folder of run folders (default: runtime.run_dir)."),
    bus: str | None = typer.Option(None, "--bus",
                                   help="Coordinator PUB address, e.g. tcp://host:port "
                                        "(with --keys, or a JOB for its keys)."),
    keys: Path | None = typer.Option(None, "--keys", help="The job's bus keys folder."),
    once: bool = typer.Option(False, "--once", help="Print one frame after the first snapshot "
                                                    "and exit."),
    timeout_s: float = seconds_option(15.0, "--timeout",
                                      help="With --once: seconds to wait for a snapshot."),
    json_mode: bool = JsonFlag,
) -> None:
    """Live view: ranks and roles, KV use and CTB budgets, step mode, RAS/TPRM, goodput. q quits."""
    if json_mode and not once:
        raise CLIError("tiderl top: --json needs --once", EXIT_USAGE)
    target = find_target(job, run_root, bus, keys)
    if once:
        _print_once(target, timeout_s, Output(json_mode))
        return
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is the other way to quit
        _watch(target)


# ------------------------------------------------------------------ what to watch

def find_target(job: str | None, run_root: Path | None, bus: str | None,
                keys_dir: Path | None) -> Target:
    """The job and endpoint named on the command line; CLIError (one line) otherwise."""
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import resolve_job
    from tiderl.runtime.bus import BusKeyError, load_job_keys

    found = None
    if job is not None:
        try:
            found = resolve_job(job, run_root)
        except LaunchError as exc:
            raise CLIError(f"tiderl top: {exc}") from None
    elif bus is None:
        found = _newest_running_job(run_root)
    if bus is None:
        bus = found.info.get("pub") if found is not None else None
        if not bus:
            raise CLIError(f"tiderl top: job {found.job_id} has no PUB address in its job.json")
    if keys_dir is None:
        if found is None:
            raise CLIError("tiderl top: --bus needs --keys DIR (the job's keys folder) or a JOB",
                           EXIT_USAGE)
        keys_dir = Path(found.run_dir) / "keys"
    try:
        keys = load_job_keys(keys_dir, "operator")
    except BusKeyError as exc:
        raise CLIError(f"tiderl top: {exc}") from None
    return Target(found.job_id if found else bus, bus, keys, found)


def _newest_running_job(run_root: Path | None) -> JobRecord:
    from tiderl.launch.control import is_job_alive
    from tiderl.launch.run_folders import DEFAULT_RUN_ROOT, list_jobs

    running = [s for s in list_jobs(run_root) if is_job_alive(s) is not False]
    if not running:
        raise CLIError(f"tiderl top: no running job in {run_root or DEFAULT_RUN_ROOT}/ "
                       "(give a job id, or --bus and --keys)")
    return running[-1]


def _reload(job: JobRecord) -> JobRecord:
    from tiderl.launch.local import JobRecord, LaunchError

    with contextlib.suppress(LaunchError):
        return JobRecord.load(job.run_dir)
    return job


# ------------------------------------------------------------------ the loops

def _print_once(target: Target, timeout_s: float, out: Output) -> None:
    import msgspec

    from tiderl.cli.top_view import TopState, render
    from tiderl.launch.control import is_job_alive
    from tiderl.runtime.bus import Snapshot, Subscriber

    start = time.monotonic()
    view = TopState(job=target.label, endpoint=target.endpoint, started_at=start)
    with Subscriber(target.endpoint, target.keys) as sub:
        while view.last is None:
            msg = sub.recv(min(LIVENESS_S, max(0.0, start + timeout_s - time.monotonic())))
            if isinstance(msg, Snapshot):
                view.fold(msg, time.monotonic())
            elif target.job is not None and is_job_alive(_reload(target.job)) is False:
                raise CLIError(f"tiderl top: job {target.label} has ended (no process runs)")
            elif time.monotonic() - start >= timeout_s:
                raise CLIError(f"tiderl top: no snapshot from {target.endpoint} in "
                               f"{timeout_s:g} s (is the job running?)")
    payload = {"job": target.label, "endpoint": target.endpoint,
               "snapshot": msgspec.to_builtins(view.last)}
    out.result(payload, lambda console: console.print(render(view, time.monotonic())))


def _watch(target: Target) -> None:
    """Draw until q, Ctrl-C or SIGTERM; the terminal is restored on every way out."""
    from rich.console import Console
    from rich.live import Live

    from tiderl.cli.top_view import TopState, render
    from tiderl.launch.control import is_job_alive, is_remote
    from tiderl.runtime.signals import exit_on_sigterm

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    exit_on_sigterm()
    view = TopState(job=target.label, endpoint=target.endpoint, started_at=time.monotonic())
    # its own console: Output's soft-wraps, which a Live redrawn in place must not do
    console = Console(highlight=False)
    with _keyboard() as read_keys, _Bus(target) as bus, \
            Live(render(view, time.monotonic()), console=console, screen=True,
                 auto_refresh=False) as live:
        drawn_at = checked_at = 0.0
        job = target.job
        while not any(key in "qQ" for key in read_keys()):
            snaps = bus.poll(TICK_S)
            now = time.monotonic()
            for snap in snaps:
                view.fold(snap, now)
            # an SSH job's nodes are asked only while the bus is silent (a read costs ~0.1 s)
            remote = job is not None and is_remote(job)
            if job is not None and now - checked_at >= (RECONNECT_S if remote else LIVENESS_S) \
                    and (not remote or view.silence_s(now) >= RECONNECT_S):
                job, checked_at = _reload(job), now
                view.is_job_ended = is_job_alive(job) is False
            if not view.is_job_ended and view.silence_s(now) >= RECONNECT_S:
                bus.reconnect(_endpoint(target, job))
            if snaps or now - drawn_at >= REDRAW_S:
                live.update(render(view, now), refresh=True)
                drawn_at = now


def _endpoint(target: Target, job: JobRecord | None) -> str:
    """Where to reconnect: the job's PUB as job.json says now, unless --bus named another."""
    if job is None or target.job is None or target.endpoint != target.job.info.get("pub"):
        return target.endpoint
    return job.info.get("pub") or target.endpoint


class _Bus:
    """The Subscriber, reopened by :meth:`reconnect` at most once per RECONNECT_S."""

    def __init__(self, target: Target) -> None:
        self._keys = target.keys
        self._sub = _subscriber(target.endpoint, target.keys)
        self._opened_at = time.monotonic()

    def poll(self, timeout_s: float) -> list[Snapshot]:
        """The snapshots that arrived within ``timeout_s``: the first waited for, the rest
        drained."""
        from tiderl.runtime.bus import Snapshot

        msg = self._sub.recv(timeout_s)
        snaps = []
        while msg is not None:
            if isinstance(msg, Snapshot):
                snaps.append(msg)
            msg = self._sub.recv(0)
        return snaps

    def reconnect(self, endpoint: str) -> None:
        if time.monotonic() - self._opened_at < RECONNECT_S:
            return
        self._sub.close()
        self._sub = _subscriber(endpoint, self._keys)
        self._opened_at = time.monotonic()

    def __enter__(self) -> _Bus:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sub.close()


def _subscriber(endpoint: str, keys: JobKeys) -> Subscriber:
    from tiderl.runtime.bus import Subscriber

    return Subscriber(endpoint, keys)


@contextlib.contextmanager
def _keyboard() -> Iterator:
    """A function returning the keys typed since its last call. Reads stdin in cbreak mode (keys
    without Enter, no echo; Ctrl-C still interrupts) only when it is a terminal; otherwise it
    returns nothing and only Ctrl-C quits."""
    if not sys.stdin.isatty():
        yield lambda: ""
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read_keys() -> str:
        if not select.select([fd], [], [], 0)[0]:
            return ""
        return os.read(fd, 64).decode(errors="replace")

    try:
        yield read_keys
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
