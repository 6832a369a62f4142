"""`tiderl launch`: resolve the profile, plan the processes, run the job to its end."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.options import ProfileOpt, SetOpt
from tiderl.cli.output import JsonFlag, Output, table

if TYPE_CHECKING:  # imported where used: `tiderl --help` loads none of them
    from rich.console import Console

    from tiderl.launch.hosts import Hosts
    from tiderl.launch.plan import LaunchPlan
    from tiderl.profile import Profile

def launch(
    nodes: Path | None = typer.Option(None, "--nodes", help="hosts.yaml; omit to run here."),
    profile: str = ProfileOpt,
    overrides: list[str] | None = SetOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved profile and plan."),
    run_root: Path | None = typer.Option(None, "--run-root",
                                         help="Folder of run folders (default: runtime.run_dir)."),
    resume: str | None = typer.Option(
        None, "--resume", metavar="JOB",
        help="Go on with a stopped or killed job (a job id, a run folder, or 'latest') from its "
             "newest complete checkpoint, with its own profile (--set may change "
             "runtime.steps and other keys that keep the job's shape)."),
    json_mode: bool = JsonFlag,
) -> None:
    """Start the environment service, the coordinator and the rank daemons of one job (this
    machine by default, or the nodes of hosts.yaml over SSH), follow it with a progress line
    and print where its report is.

    Ctrl-C or SIGTERM stop every process of the job, on every node; a job that stops before
    its last step resumes with --resume."""
    from tiderl.launch.hosts import PORT_NAMES, HostsError, load_hosts
    from tiderl.launch.plan import engine_port_names, plan_local, plan_nodes
    from tiderl.profile import load_profile

    resumed = None
    if resume is not None:
        if nodes is not None:
            raise CLIError("tiderl launch: --resume runs on this machine only (not with "
                           "--nodes yet)", EXIT_USAGE)
        resumed = _resumable(resume, run_root)
        resolved = _resumed_profile(resumed, overrides or [])
    else:
        resolved = load_profile(profile, overrides or [])
    hosts = None
    if nodes is not None:
        try:
            hosts = load_hosts(nodes)
            plan = plan_nodes(hosts, resolved, "<job>", _port_placeholders(hosts, resolved))
        except HostsError as exc:
            raise CLIError(str(exc), EXIT_USAGE) from None
    else:  # the command lines with placeholders for the ports a launch picks
        from tiderl.launch.job import check_here, local_endpoints
        from tiderl.launch.local import LaunchError

        try:
            check_here(resolved)
        except LaunchError as exc:
            raise CLIError(f"tiderl launch: {exc}", EXIT_USAGE) from None
        ports = {name: f"<{name}-port>" for name in (*PORT_NAMES, *engine_port_names(resolved))}
        plan = plan_local(resolved, sys.executable, str(Path(resolved.runtime.run_dir, "<job>")),
                          local_endpoints(resolved, ports))
    out = Output(json_mode)
    if dry_run:
        out.result(_payload(resolved, plan), lambda console: _render(console, resolved, plan))
        return
    _run(resolved, hosts, run_root, out, resumed)


SHAPE_KEYS = (("runtime", "mode"), ("runtime", "num_ranks"), ("runtime", "group_size"),
              ("trainer", "backend"), ("trainer", "tensor_parallel"), ("model", "size"),
              ("model", "path"))


def _resumable(job: str, run_root: Path | None) -> Path:
    """The run folder ``--resume`` names, if no process of it runs."""
    from tiderl.launch.local import JobRecord, LaunchError, is_running
    from tiderl.launch.run_folders import job_dir, list_jobs
    from tiderl.runtime.resume import CHECKPOINTS
    from tiderl.trainer.checkpoint_meta import step_folders

    try:
        if job == "latest":
            jobs = [s for s in list_jobs(run_root) if step_folders(Path(s.run_dir, CHECKPOINTS))]
            if not jobs:
                raise LaunchError(f"no job with a checkpoint in {run_root or 'runs'}/")
            folder = Path(jobs[-1].run_dir)
        else:
            folder = job_dir(job, run_root)
        state = JobRecord.load(folder)
    except LaunchError as exc:
        raise CLIError(f"tiderl launch --resume: {exc}", EXIT_USAGE) from None
    alive = [p.name for p in state.processes if p.host == "localhost" and is_running(p.pid)]
    if alive:
        raise CLIError(f"tiderl launch --resume: job {state.job_id} is running ({', '.join(alive)}"
                       f"); stop it first (tiderl stop {state.job_id})", EXIT_USAGE)
    return folder


def _resumed_profile(run_dir: Path, overrides: list[str]) -> Profile:
    """The job's own profile with ``overrides``, which may not change the job's shape."""
    from tiderl.profile import load_profile

    own = load_profile(str(run_dir / "profile.yaml"))
    new = load_profile(str(run_dir / "profile.yaml"), overrides)
    for section, key in SHAPE_KEYS:
        was, now = getattr(getattr(own, section), key), getattr(getattr(new, section), key)
        if was != now:
            raise CLIError(f"tiderl launch --resume: {section}.{key} is {was!r} in the job, "
                           f"--set makes it {now!r}: a resumed job keeps its shape", EXIT_USAGE)
    return new


def _port_placeholders(hosts: Hosts, profile: Profile) -> dict[str, int | str]:
    from tiderl.launch.hosts import PORT_NAMES
    from tiderl.launch.plan import engine_port_names

    names = (*PORT_NAMES, *engine_port_names(profile))
    if hosts.port_base is not None:
        return {name: hosts.port_base + i for i, name in enumerate(names)}
    return {name: f"<{name}-port>" for name in names}


def _run(profile: Profile, hosts: Hosts | None, run_root: Path | None, out: Output,
         resume: Path | None = None) -> None:
    from tiderl.cli.progress import JobProgress
    from tiderl.launch.job import run_local
    from tiderl.launch.local import LaunchError
    from tiderl.launch.remote import run_ssh
    from tiderl.runtime.signals import exit_on_sigterm

    exit_on_sigterm()  # stop the job like Ctrl-C
    # Ctrl-C stops the job even when the launcher started with SIGINT ignored (as a background
    # job of a non-interactive shell is), which Python would otherwise keep
    signal.signal(signal.SIGINT, signal.default_int_handler)
    progress = JobProgress(out, profile.runtime.steps)

    def on_start(state) -> None:  # the progress line shows once every process is started
        out.note(f"job {state.job_id}: {state.run_dir} (logs in {state.run_dir}/logs)")
        progress.start()

    try:
        kwargs = {"run_root": run_root, "on_snapshot": progress.update, "on_start": on_start,
                  "launcher_pid": os.getpid()}
        try:
            result = (run_local(profile, resume=resume, **kwargs) if hosts is None
                      else run_ssh(profile, hosts, **kwargs))
        finally:
            progress.stop()
    except LaunchError as exc:
        raise CLIError(f"tiderl launch: {exc}") from exc
    except KeyboardInterrupt:
        raise CLIError("tiderl launch: interrupted; every process of the job was stopped",
                       130) from None
    except SystemExit as exc:  # SIGTERM (e.g. from `tiderl stop`)
        raise CLIError("tiderl launch: terminated; every process of the job was stopped",
                       exc.code if isinstance(exc.code, int) else 143) from None
    payload = {"job": result.job_id, "run_dir": str(result.run_dir),
               "report": str(result.report) if result.report else None,
               "exit_code": result.exit_code,
               "last": dict(result.last.metrics) if result.last else None}
    if result.exit_code != 0:
        from tiderl.launch.job import last_stop

        stop = last_stop(result.run_dir)
        why = stop.get("reason") or f"the coordinator failed (exit {result.exit_code})"
        hint = f"; {stop['resume']}" if stop.get("resume") else ""
        raise CLIError(f"tiderl launch: job {result.job_id} stopped: {why}{hint} "
                       f"(see {result.run_dir}/logs/coordinator.log)")
    out.result(payload, lambda console: console.print(
        f"done: {result.job_id}  report: {result.report}"))


def _payload(profile: Profile, plan: LaunchPlan) -> dict:
    from tiderl.profile import profile_to_dict

    return {
        "profile": profile_to_dict(profile),
        "plan": [
            {"name": p.name, "kind": p.kind, "host": p.host, "rank": p.rank,
             "role": p.role.value if p.role else None, "device": p.device, "threads": p.threads,
             "command": list(p.argv), "env": p.env}
            for p in plan.processes
        ],
    }


def _render(console: Console, profile: Profile, plan: LaunchPlan) -> None:
    from tiderl.profile import profile_to_dict

    for section, values in profile_to_dict(profile).items():
        rows = list(_flatten(values))
        console.print(table(section, ("key", "value"), rows))
    rows = [(p.name, p.kind, p.host, p.role.value if p.role else "", p.device or "",
             p.threads or "") for p in plan.processes]
    console.print(table("plan", ("process", "kind", "node", "role", "device", "threads"), rows))
    if any(p.argv for p in plan.processes):
        for p in plan.processes:
            env = " ".join(f"{k}={v}" for k, v in p.env.items())
            console.print(f"[bold]{p.name}[/] on {p.host}: {env + ' ' if env else ''}"
                          f"{shlex.join(p.argv)}", soft_wrap=True)


def _flatten(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            yield f"{prefix}{key}", "[" + ", ".join(map(str, value)) + "]"
        else:
            yield f"{prefix}{key}", value
