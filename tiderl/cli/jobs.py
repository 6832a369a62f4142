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
from tiderl.cli.options import count_option, seconds_option
from tiderl.cli.output import JsonFlag, Output, table

if TYPE_CHECKING:  # imported where used: `tiderl --help` loads no SSH client
    from tiderl.launch.control import JobStatus
    from tiderl.launch.local import JobRecord

RunRootOpt = typer.Option(None, "--run-root", help="Folder of run folders (default: runs/).")
FOLLOW_POLL_S = 0.5  # logs -f: new lines, and whether the job has ended (/proc, or SFTP reads)


def status(
    job: str | None = typer.Argument(None, help="Job id; omit for every job in the run root."),
    run_root: Path | None = RunRootOpt,
    json_mode: bool = JsonFlag,
) -> None:
    """Show the processes of a job (node, PID, state) or one line per job: how it ended
    (done, failed, stopped, interrupted, crashed) once it runs no more."""
    from tiderl.launch.control import job_status
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import list_jobs, resolve_job

    out = Output(json_mode)
    try:
        if job is None:
            rows = [_job_row(found, job_status(found)) for found in list_jobs(run_root)]
            out.result(rows, lambda console: _render_jobs(console, rows, run_root))
            return
        job_record = resolve_job(job, run_root)
        summary = job_status(job_record, strict=True)
    except LaunchError as exc:
        raise CLIError(f"tiderl status: {exc}") from None
    rows = [{"name": r.name, "kind": r.kind, "node": r.host, "pid": r.pid,
             "state": _describe(summary.process_states[r.name]), "log": r.log}
            for r in job_record.processes]
    payload = {**_job_row(job_record, summary), "processes": rows}
    # a log's path in its node's run folder (the whole path is in --json)
    logs = [str(Path(r.log).relative_to(r.run_dir)) for r in job_record.processes]
    title = (f"{job_record.job_id}  {summary.state}  steps {payload['steps']}  "
             f"({job_record.run_dir})")
    out.result(payload, lambda console: console.print(table(
        title, ("process", "kind", "node", "pid", "state", "log"),
        [(r["name"], r["kind"], r["node"], r["pid"], r["state"], log)
         for r, log in zip(rows, logs, strict=True)])))


def _job_row(job_record: JobRecord, summary: JobStatus) -> dict:
    """A job's line of ``tiderl status``."""
    total = "?" if summary.steps_total is None else summary.steps_total
    return {"job": job_record.job_id, "system": job_record.info.get("system", ""),
            "started": f"{datetime.fromtimestamp(job_record.created):%Y-%m-%d %H:%M:%S}",
            "where": summary.where,
            "processes": f"{summary.num_running}/{summary.num_processes}",
            "steps": f"{summary.steps_done}/{total}", "state": summary.state}


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


def _describe(letter: str | None) -> str:
    if letter is None:
        return "gone"
    return "zombie (ended)" if letter in ("Z", "X") else f"running ({letter})"


def logs(
    job: str = typer.Argument(..., help="Job id."),
    rank: int | None = count_option(None, "--rank", help="Only this rank's log."),
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
        job_record = resolve_job(job, run_root)
        records = select(job_record, rank, process)
        prefix = len(records) > 1
        offsets = dict.fromkeys((r.name for r in records), 0)
        with sessions(job_record) as nodes:
            while True:
                # whether it has ended, read before its logs: what it wrote before is in them
                ended = not follow or not is_job_alive(job_record, nodes)
                for record in records:
                    fallback = Path(job_record.run_dir) / "logs" / Path(record.log).name
                    data = read_log(record, nodes, offsets[record.name], fallback)
                    if data:
                        text = data.decode(errors="replace")
                        if not ended and not text.endswith("\n"):  # print whole lines only
                            text = text[:text.rfind("\n") + 1]
                        offsets[record.name] += len(text.encode())
                        _print_lines(text, record.name if prefix else None)
                if ended:
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
    grace: float = seconds_option(10.0, "--grace", help="Seconds between SIGTERM and SIGKILL."),
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
        job_record = resolve_job(job, run_root)
        launcher, outcome = stop_job(job_record, grace)
    except LaunchError as exc:
        raise CLIError(f"tiderl stop: {exc}") from None
    payload = {"job": job_record.job_id, "launcher_stopped": launcher,
               "processes": [{"name": r.name, "node": r.host, "pid": r.pid,
                              "outcome": outcome[r.name]} for r in job_record.processes]}
    note = "its launcher stopped it; " if launcher else ""
    out.result(payload, lambda console: console.print(table(
        f"{job_record.job_id}: {note}no process left", ("process", "node", "pid", "outcome"),
        [(p["name"], p["node"], p["pid"], p["outcome"]) for p in payload["processes"]])))

