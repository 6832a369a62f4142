"""Going on with a stopped or killed job (``tiderl launch --resume JOB``), the launcher's side:
which run folder, with which profile, made ready how. The checkpoints themselves (which one is
complete, ``resume.json``) are :mod:`tiderl.runtime.resume`'s.

    resumable_run_dir(job, run_root)     the job's folder (named, or 'latest': the newest one
                                         with a checkpoint), if none of its processes runs
    resumed_profile(run_dir, overrides)  its own profile.yaml with the overrides, same shape
    prepare_resume(profile, run_dir)     the roles of its newest complete checkpoint, which
                                         resume.json names

A job keeps its shape (:data:`SHAPE_KEYS`: the ranks, the model, the trainer's layout): its
checkpoints are of that shape. Anything else, ``job.steps`` first, may change.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tiderl.core.quote import short
from tiderl.core.types import Role
from tiderl.launch.local import JobRecord, LaunchError, LaunchRefused, is_running
from tiderl.launch.plan import RUN_PROFILE
from tiderl.launch.run_folders import job_dir, list_jobs
from tiderl.profile import Profile, load_profile
from tiderl.runtime.resume import (
    CHECKPOINTS,
    latest_complete,
    read_checkpoint_state,
    write_resume_request,
)
from tiderl.trainer.checkpoint_meta import CheckpointError, step_folders

log = logging.getLogger("tiderl.launch")

SHAPE_KEYS = (("runtime", "system"), ("runtime", "num_ranks"), ("job", "group_size"),
              ("trainer", "backend"), ("trainer", "tensor_parallel"), ("model", "size"),
              ("model", "path"))


class ResumeError(LaunchRefused):
    """The job named cannot be resumed as asked: there is no such job, it still runs, or the
    overrides change its shape."""


def resumable_run_dir(job: str, run_root: Path | None = None) -> Path:
    """The run folder of ``job`` (a job id, a run folder, or ``latest``: the newest job with a
    checkpoint), if no process of it runs."""
    try:
        if job == "latest":
            jobs = [s for s in list_jobs(run_root) if step_folders(Path(s.run_dir, CHECKPOINTS))]
            if not jobs:
                raise ResumeError(f"no job with a checkpoint in {run_root or 'runs'}/")
            folder = Path(jobs[-1].run_dir)
        else:
            folder = job_dir(job, run_root)
        record = JobRecord.load(folder)
    except ResumeError:
        raise
    except LaunchError as exc:
        raise ResumeError(str(exc)) from None
    alive = [p.name for p in record.processes if p.host == "localhost" and is_running(p.pid)]
    if alive:
        raise ResumeError(f"job {record.job_id} is running ({', '.join(alive)}); stop it "
                          f"first (tiderl stop {record.job_id})")
    return folder


def resumed_profile(run_dir: Path, overrides: list[str]) -> Profile:
    """The job's own profile with ``overrides``, which may not change the job's shape."""
    own = load_profile(str(run_dir / RUN_PROFILE))
    new = load_profile(str(run_dir / RUN_PROFILE), overrides)
    for section, key in SHAPE_KEYS:
        was, now = getattr(getattr(own, section), key), getattr(getattr(new, section), key)
        if was != now:
            raise ResumeError(f"{section}.{key} is {short(was)} in the job, --set makes it "
                              f"{short(now)}: a resumed job keeps its shape")
    return new


def prepare_resume(profile: Profile, run_dir: Path) -> list[Role]:
    """The roles a killed or stopped job goes on with: its newest complete checkpoint's, which
    ``resume.json`` names for the coordinator and the ranks (LaunchError when there is none, or
    when the job is already at its last step). The caller writes the profile (with any new
    overrides), the roles and new bus keys (:func:`tiderl.launch.job.prepare_run_dir`)."""
    try:
        choice = latest_complete(run_dir / CHECKPOINTS, profile.trainer.tensor_parallel)
    except CheckpointError as exc:
        raise LaunchError(f"cannot resume {run_dir.name}: {exc}") from None
    for skipped in choice.skipped:
        log.warning("passed over checkpoint %s", skipped)
    state = read_checkpoint_state(choice.folder)
    if state.point.version >= profile.job.steps:
        raise LaunchError(f"job {run_dir.name} is complete: step {state.point.version} of "
                          f"{profile.job.steps} (--set job.steps=N trains on)")
    if len(state.point.roles) != profile.runtime.num_ranks:
        raise LaunchError(f"checkpoint {choice.folder} is of {len(state.point.roles)} ranks, "
                          f"the profile has runtime.num_ranks {profile.runtime.num_ranks}")
    write_resume_request(run_dir, choice.folder)
    log.info("resuming %s from %s (step %d)", run_dir.name, choice.folder.name,
             state.point.version)
    return list(state.point.roles)
