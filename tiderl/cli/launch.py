"""`tiderl launch`: the launch request (profile, nodes, a job to resume), then its plan
(``--dry-run``) or its run to the end, followed with a progress line
(:mod:`tiderl.cli.progress`)."""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.options import ProfileOpt, SetOpt
from tiderl.cli.output import JsonFlag, Output, table

if TYPE_CHECKING:  # imported where used: `tiderl --help` loads none of them
    from rich.console import Console

    from tiderl.launch.job import JobResult
    from tiderl.launch.local import JobRecord
    from tiderl.launch.plan import LaunchPlan
    from tiderl.launch.request import LaunchRequest
    from tiderl.profile import Profile


def launch(
    nodes: Path | None = typer.Option(None, "--nodes", help="hosts.yaml; omit to run here."),
    slurm: bool = typer.Option(
        False, "--slurm", help="Run in the Slurm allocation this shell is in (salloc, sbatch): "
                               "its nodes and GPUs, each node's processes in a job step."),
    profile: str = ProfileOpt,
    overrides: list[str] | None = SetOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved profile and plan."),
    run_root: Path | None = typer.Option(None, "--run-root",
                                         help="Folder of run folders (default: runtime.run_dir)."),
    resume: str | None = typer.Option(
        None, "--resume", metavar="JOB",
        help="Go on with a stopped or killed job (a job id, a run folder, or 'latest') from its "
             "newest complete checkpoint, with its own profile (--set may change "
             "job.steps and other keys that keep the job's shape)."),
    json_mode: bool = JsonFlag,
) -> None:
    """Start the environment service, the coordinator and the rank daemons of one job (this
    machine by default, the nodes of hosts.yaml over SSH, or a Slurm allocation's with srun),
    follow it with a progress line and print where its report is.

    Ctrl-C or SIGTERM stop every process of the job, on every node; a job that stops before
    its last step resumes with --resume."""
    from tiderl.launch.hosts import HostsError
    from tiderl.launch.local import LaunchError
    from tiderl.launch.request import launch_request, preview_plan

    out = Output(json_mode)
    try:
        request = launch_request(profile, overrides or [], nodes, resume, run_root, slurm)
        plan = preview_plan(request) if dry_run else None
    except (LaunchError, HostsError) as exc:
        raise _cli_error(exc) from exc
    if plan is not None:
        steps = _srun_lines(request, plan)
        out.result({**_payload(request.profile, plan), **({"srun": steps} if steps else {})},
                   lambda console: _render(console, request.profile, plan, steps))
        return
    result = _run(request, out)
    payload = {"job": result.job_id, "run_dir": str(result.run_dir),
               "report": str(result.report) if result.report else None,
               "exit_code": result.exit_code,
               "last": dict(result.last.metrics) if result.last else None}
    out.result(payload, lambda console: console.print(
        f"done: {result.job_id}  report: {result.report}"))


def _cli_error(exc: Exception) -> CLIError:
    """The one line of a launch that failed (a LaunchError or a HostsError): exit 2 when it
    could not run as asked (nothing was made or started), 1 when a process of the job or a
    node failed."""
    from tiderl.launch.hosts import HostsError
    from tiderl.launch.local import LaunchRefused
    from tiderl.launch.resume import ResumeError

    if isinstance(exc, ResumeError):
        return CLIError(f"tiderl launch --resume: {exc}", EXIT_USAGE)
    if isinstance(exc, LaunchRefused):
        return CLIError(f"tiderl launch: {exc}", EXIT_USAGE)
    if isinstance(exc, HostsError):  # its line names hosts.yaml
        return CLIError(str(exc), EXIT_USAGE)
    return CLIError(f"tiderl launch: {exc}")


def _run(request: LaunchRequest, out: Output) -> JobResult:
    """Run the job, with the progress line; CLIError unless it ran to its end."""
    from tiderl.cli.progress import JobProgress
    from tiderl.launch.hosts import HostsError
    from tiderl.launch.local import LaunchError
    from tiderl.launch.request import launch_job
    from tiderl.runtime.signals import exit_on_sigterm

    exit_on_sigterm()  # stop the job like Ctrl-C
    # Ctrl-C stops the job even when the launcher started with SIGINT ignored (as a background
    # job of a non-interactive shell is), which Python would otherwise keep
    signal.signal(signal.SIGINT, signal.default_int_handler)
    progress = JobProgress(out, request.profile.job.steps)

    def on_start(job: JobRecord) -> None:  # the progress line shows once every process is started
        out.note(f"job {job.job_id}: {job.run_dir} (logs in {job.run_dir}/logs)")
        progress.start()

    try:
        try:
            result = launch_job(request, on_snapshot=progress.update, on_start=on_start,
                                launcher_pid=os.getpid())
        finally:
            progress.stop()
    except KeyboardInterrupt:
        raise CLIError("tiderl launch: interrupted; every process of the job was stopped",
                       130) from None
    except SystemExit as exc:  # SIGTERM (e.g. from `tiderl stop`)
        raise CLIError("tiderl launch: terminated; every process of the job was stopped",
                       exc.code if isinstance(exc.code, int) else 143) from None
    except (LaunchError, HostsError) as exc:
        raise _cli_error(exc) from exc
    if result.exit_code != 0:
        why = result.stop_reason or f"the coordinator failed (exit {result.exit_code})"
        hint = f"; {result.resume_hint}" if result.resume_hint else ""
        raise CLIError(f"tiderl launch: job {result.job_id} stopped: {why}{hint} "
                       f"(see {result.run_dir}/logs/coordinator.log)")
    return result


# ------------------------------------------------------------------ --dry-run

def _payload(profile: Profile, plan: LaunchPlan) -> dict:
    from tiderl.profile import profile_to_dict
    from tiderl.runtime.step_config import profile_effective_view

    return {
        "profile": profile_to_dict(profile),
        "effective": profile_effective_view(profile),
        "plan": [
            {"name": p.name, "kind": p.kind, "host": p.host, "rank": p.rank,
             "role": p.role.value if p.role else None, "device": p.device, "threads": p.threads,
             "command": list(p.argv), "env": p.env}
            for p in plan.processes
        ],
    }


def _srun_lines(request: LaunchRequest, plan: LaunchPlan) -> list[str]:
    """Under --slurm, the job step of each node (its processes are the plan's)."""
    if request.slurm is None:
        return []
    from tiderl.launch.slurm import dry_run_lines

    return dry_run_lines(plan, request.slurm)


def _render(console: Console, profile: Profile, plan: LaunchPlan,
            steps: list[str] | None = None) -> None:
    from rich.markup import escape

    from tiderl.profile import profile_to_dict
    from tiderl.runtime.step_config import profile_effective_view

    for section, values in profile_to_dict(profile).items():
        rows = list(_flatten(values))
        console.print(table(section, ("key", "value"), rows))
    render_effective(console, profile_effective_view(profile))
    rows = [(p.name, p.kind, p.host, p.role.value if p.role else "", p.device or "",
             p.threads or "") for p in plan.processes]
    console.print(table("plan", ("process", "kind", "node", "role", "device", "threads"), rows))
    if any(p.argv for p in plan.processes):
        for p in plan.processes:
            env = " ".join(f"{k}={v}" for k, v in p.env.items())
            console.print(f"[bold]{p.name}[/] on {p.host}: {env + ' ' if env else ''}"
                          f"{shlex.join(p.argv)}", soft_wrap=True)
    for line in steps or ():
        console.print(f"[bold]job step[/]: {escape(line)}", soft_wrap=True)


def render_effective(console: Console, view: dict) -> None:
    """What the system runs (:func:`tiderl.core.step_control.effective_view`): the policy
    settings it runs otherwise than the profile says, then what it derives."""
    changes = view["changes"]
    rows = [(key, f"{used} (profile: {given})") for key, (given, used) in changes.items()]
    rows += [(key, value) for key, value in view.items() if key not in ("system", "changes")]
    console.print(table(f"effective: what system {view['system']} runs", ("key", "value"), rows))


def _flatten(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            yield f"{prefix}{key}", "[" + ", ".join(map(str, value)) + "]"
        else:
            yield f"{prefix}{key}", value
