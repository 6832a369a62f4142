"""Job control: `tiderl status`, `tiderl logs`, `tiderl stop` (they read runs/<job>/job.json and
reach an SSH job's nodes again over SSH)."""

from __future__ import annotations

import contextlib
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tiderl.cli.errors import CLIError
from tiderl.cli.output import JsonFlag, Output, table

if TYPE_CHECKING:  # imported where used: `tiderl --help` loads no SSH client
    from tiderl.launch.local import JobRecord

RunRootOpt = typer.Option(None, "--run-root", help="Folder of run folders (default: runs/).")
FOLLOW_POLL_S = 0.5
ENDED_CHECK_S = 2.0


def status(
    job: str | None = typer.Argument(None, help="Job id; omit for every job in the run root."),
    run_root: Path | None = RunRootOpt,
    json_mode: bool = JsonFlag,
) -> None:
    """Show the processes of a job (node, PID, state) or one line per job: how it ended
    (done, failed, stopped, interrupted, crashed) once it runs no more."""
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import list_jobs, resolve_job

    out = Output(json_mode)
    try:
        if job is None:
            rows = [_job_summary(state)[0] for state in list_jobs(run_root)]
            out.result(rows, lambda console: _render_jobs(console, rows, run_root))
            return
        state = resolve_job(job, run_root)
        summary, states = _job_summary(state, strict=True)
    except LaunchError as exc:
        raise CLIError(f"tiderl status: {exc}") from None
    rows = [{"name": r.name, "kind": r.kind, "node": r.host, "pid": r.pid,
             "state": _describe(states[r.name]), "log": r.log} for r in state.processes]
    payload = {**summary, "processes": rows}
    # a log's path in its node's run folder (the whole path is in --json)
    logs = [str(Path(r.log).relative_to(r.run_dir)) for r in state.processes]
    out.result(payload, lambda console: console.print(table(
        f"{state.job_id}  {payload['state']}  steps {payload['steps']}  ({state.run_dir})",
        ("process", "kind", "node", "pid", "state", "log"),
        [(r["name"], r["kind"], r["node"], r["pid"], r["state"], log)
         for r, log in zip(rows, logs, strict=True)])))


def _render_jobs(console, rows: list[dict], run_root: Path | None) -> None:
    """One line per job, the id never cut (``logs`` and ``stop`` take it); its mode and start
    time are in the id (and in --json); with no job, where status looked."""
    from tiderl.launch.run_folders import DEFAULT_RUN_ROOT

    if not rows:
        root = Path(run_root or DEFAULT_RUN_ROOT).resolve()
        hint = "" if run_root else (f" ({DEFAULT_RUN_ROOT}/ of this folder; give --run-root DIR "
                                    "for jobs launched from another one)")
        console.print(f"no jobs in {root}/{hint}", markup=False)
        return
    console.print(table("jobs", ("job", "where", "processes", "steps", "state"),
                        [(r["job"], r["where"], r["processes"], r["steps"], r["state"])
                         for r in rows], keep=("job", "state")))


def _job_summary(state: JobRecord, strict: bool = False
                 ) -> tuple[dict, dict[str, str | None]]:
    """The job's line and its processes' states, over one set of SSH sessions for an SSH job.
    Nodes that do not answer: an error when ``strict``, else the state "unreachable" (and the
    steps of the copy fetched at the job's end)."""
    from tiderl.launch.control import alive, is_remote, process_states, sessions
    from tiderl.launch.local import LaunchError

    try:
        with sessions(state) as nodes:
            states = process_states(state, nodes)
            steps = _steps(state, nodes)
            ended = _ended(state, nodes)
    except LaunchError:
        if strict:
            raise
        states, steps, ended = {}, _steps(state, None), _ended(state, None)
    running = sum(alive(letter) for letter in states.values())
    total = len(state.processes)
    if not states and is_remote(state):
        word = "unreachable"
    else:
        word = "running" if running == total and total else ended if not running else "partial"
    return {"job": state.job_id, "mode": state.info.get("mode", ""),
            "started": f"{datetime.fromtimestamp(state.created):%Y-%m-%d %H:%M:%S}",
            "where": ", ".join(state.info["nodes"]) if is_remote(state) else "local",
            "processes": f"{running}/{total}", "steps": steps, "state": word}, states


def _steps(state: JobRecord, nodes: dict | None) -> str:
    """Steps done, from the job's metrics.jsonl (fetched from an SSH job's node)."""
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import job_file

    try:
        done = len(job_file(state, "metrics.jsonl", nodes).read_text().splitlines())
    except LaunchError:
        done = 0
    return f"{done}/{state.info.get('steps', '?')}"


ENDED = {"ok": "done", "failed": "failed", "stopped": "stopped", "interrupted": "interrupted"}


def _ended(state: JobRecord, nodes: dict | None) -> str:
    """How a job that runs no more ended, from its last ``stop`` event: done, failed,
    stopped (SIGTERM, ``tiderl stop``), interrupted (Ctrl-C), or crashed (none: its
    coordinator was killed)."""
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import job_file, last_stop

    try:
        stop = last_stop(job_file(state, "events.jsonl", nodes).parent)
    except LaunchError:
        stop = {}
    return ENDED.get(stop.get("state", "ok" if stop.get("reason") == "done" else ""),
                     "crashed")


def _describe(letter: str | None) -> str:
    if letter is None:
        return "gone"
    return "zombie (ended)" if letter in ("Z", "X") else f"running ({letter})"


def logs(
    job: str = typer.Argument(..., help="Job id."),
    rank: int | None = typer.Option(None, "--rank", help="Only this rank's log."),
    process: str | None = typer.Option(None, "--process",
                                       help="Only this process's log: env, coordinator, rankN."),
    follow: bool = typer.Option(False, "--follow", "-f",
                                help="Keep printing new lines until the job ends (or Ctrl-C)."),
    run_root: Path | None = RunRootOpt,
) -> None:
    """Print a job's logs (every process's, each line prefixed with its name, unless one is
    chosen), from its nodes over SSH for an SSH job."""
    from tiderl.launch.control import is_job_alive, read_log, select, sessions
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import resolve_job

    try:
        state = resolve_job(job, run_root)
        records = select(state, rank, process)
        prefix = len(records) > 1
        offsets = dict.fromkeys((r.name for r in records), 0)
        with sessions(state) as nodes:
            checked = time.monotonic()
            while True:
                for record in records:
                    fallback = Path(state.run_dir) / "logs" / Path(record.log).name
                    data = read_log(record, nodes, offsets[record.name], fallback)
                    if data:
                        text = data.decode(errors="replace")
                        if follow and not text.endswith("\n"):  # print whole lines only
                            text = text[:text.rfind("\n") + 1]
                        offsets[record.name] += len(text.encode())
                        _print_lines(text, record.name if prefix else None)
                if not follow:
                    return
                if time.monotonic() - checked >= ENDED_CHECK_S:
                    checked = time.monotonic()
                    if not is_job_alive(state, nodes):
                        return
                time.sleep(FOLLOW_POLL_S)
    except LaunchError as exc:
        raise CLIError(f"tiderl logs: {exc}") from None
    except KeyboardInterrupt:
        return


def _print_lines(text: str, name: str | None) -> None:
    if name is not None:
        text = "".join(f"{name:>11} | {line}\n" for line in text.splitlines())
    sys.stdout.write(text)
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()


def stop(
    job: str = typer.Argument(..., help="Job id."),
    grace: float = typer.Option(10.0, "--grace", help="Seconds between SIGTERM and SIGKILL."),
    run_root: Path | None = RunRootOpt,
    json_mode: bool = JsonFlag,
) -> None:
    """Stop every process of a job on every node (SIGTERM, then SIGKILL after a grace period),
    and check by PID that none is left."""
    from tiderl.launch.control import stop_job
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import resolve_job

    out = Output(json_mode)
    try:
        state = resolve_job(job, run_root)
        launcher, outcome = stop_job(state, grace)
    except LaunchError as exc:
        raise CLIError(f"tiderl stop: {exc}") from None
    payload = {"job": state.job_id, "launcher_stopped": launcher,
               "processes": [{"name": r.name, "node": r.host, "pid": r.pid,
                              "outcome": outcome[r.name]} for r in state.processes]}
    note = "its launcher stopped it; " if launcher else ""
    out.result(payload, lambda console: console.print(table(
        f"{state.job_id}: {note}no process left", ("process", "node", "pid", "outcome"),
        [(p["name"], p["node"], p["pid"], p["outcome"]) for p in payload["processes"]])))

