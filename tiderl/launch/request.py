"""What ``tiderl launch`` asks of the library: a launch request (the profile, fresh or a stopped
job's; the nodes, or this machine), the plan it would run (``--dry-run``), and the run.

    launch_request(profile, --set, --nodes | --slurm, --resume) ─> LaunchRequest
        preview_plan(request)  ─> LaunchPlan with placeholder ports (nothing starts)
        launch_job(request)    ─> run_local | run_ssh | run_slurm ─> JobResult

Errors: ResumeError and LaunchRefused (the job cannot run as asked: nothing is made or started),
HostsError (hosts.yaml), LaunchError (a process of the job failed, or a node did), ConfigError
(the profile).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiderl.launch.hosts import Hosts, load_hosts
from tiderl.launch.job import JobResult, check_here, local_plan, run_local
from tiderl.launch.local import JobRecord, LaunchRefused
from tiderl.launch.plan import LaunchPlan, numbered_ports, plan_nodes
from tiderl.launch.resume import ResumeError, resumable_run_dir, resumed_profile
from tiderl.launch.slurm import Allocation, allocation_hosts, read_allocation, run_slurm
from tiderl.profile import Profile, load_profile
from tiderl.runtime.bus import Snapshot

JOB_PLACEHOLDER = "<job>"  # the job id a --dry-run plan shows


@dataclass(frozen=True)
class LaunchRequest:
    profile: Profile  # resolved, with the overrides
    hosts: Hosts | None = None  # None: every process on this machine
    resume: Path | None = None  # the run folder of a stopped job to go on with
    run_root: Path | None = None  # the folder of run folders (None: runtime.run_dir)
    slurm: Allocation | None = None  # the Slurm allocation the launcher runs in (--slurm)


def launch_request(profile: str, overrides: Sequence[str] = (), nodes: Path | None = None,
                   resume: str | None = None, run_root: Path | None = None,
                   slurm: bool = False) -> LaunchRequest:
    """The profile (a name or a path, with ``overrides``; with ``resume``, the job's own, whose
    shape the overrides may not change) and the nodes of ``nodes`` (a hosts.yaml), or of the
    Slurm allocation the launcher runs in (``slurm``)."""
    if slurm and (nodes is not None or resume is not None):
        raise LaunchRefused(f"--slurm takes its nodes from the allocation: not with "
                            f"{'--nodes' if nodes is not None else '--resume'}")
    resume_dir = None
    if resume is not None and nodes is not None:
        raise ResumeError("runs on this machine only (not with --nodes yet)")
    if resume is not None:
        resume_dir = resumable_run_dir(resume, run_root)
        resolved = resumed_profile(resume_dir, list(overrides))
    else:
        resolved = load_profile(profile, overrides)
    if resolved.runtime.replay and nodes is not None:
        raise LaunchRefused("runtime.replay runs on this machine only (not with --nodes yet)")
    hosts = load_hosts(nodes) if nodes is not None else None
    if slurm and resolved.runtime.replay:
        raise LaunchRefused("runtime.replay runs on this machine only (not with --slurm)")
    return LaunchRequest(resolved, hosts, resume_dir, run_root,
                         read_allocation() if slurm else None)


def preview_plan(request: LaunchRequest) -> LaunchPlan:
    """The plan the launch would run, each port it picks shown as ``<name-port>`` (hosts.yaml's
    ``ports.base`` fixes them) and the job id as ``<job>``; on this machine, after
    :func:`tiderl.launch.job.check_here`."""
    profile, hosts = request.profile, request.hosts
    if request.slurm is not None:
        root = request.run_root or Path(profile.runtime.run_dir)
        hosts = allocation_hosts(request.slurm, profile, root)
        return plan_nodes(hosts, profile, JOB_PLACEHOLDER, numbered_ports(profile, None),
                          run_dir=str(root / JOB_PLACEHOLDER))
    if hosts is not None:
        return plan_nodes(hosts, profile, JOB_PLACEHOLDER, numbered_ports(profile,
                                                                          hosts.port_base))
    check_here(profile)
    root = request.run_root or Path(profile.runtime.run_dir)
    return local_plan(profile, request.resume or root / JOB_PLACEHOLDER,
                      numbered_ports(profile, None))


def launch_job(request: LaunchRequest, *, on_snapshot: Callable[[Snapshot], None] | None = None,
               on_start: Callable[[JobRecord], None] | None = None,
               launcher_pid: int | None = None) -> JobResult:
    """Run the job to its end, on this machine or over SSH on the nodes."""
    if request.slurm is not None:
        return run_slurm(request.profile, run_root=request.run_root, on_snapshot=on_snapshot,
                         on_start=on_start, launcher_pid=launcher_pid)
    if request.hosts is None:
        return run_local(request.profile, run_root=request.run_root, resume=request.resume,
                         on_snapshot=on_snapshot, on_start=on_start, launcher_pid=launcher_pid)
    from tiderl.launch.remote import run_ssh  # the SSH client only for a job on nodes

    return run_ssh(request.profile, request.hosts, run_root=request.run_root,
                   on_snapshot=on_snapshot, on_start=on_start, launcher_pid=launcher_pid)
