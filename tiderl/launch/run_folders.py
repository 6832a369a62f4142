"""Run folders: finding a job and the files its coordinator writes. ``tiderl status | logs |
stop | top | rebalance | profile`` and ``launch --resume`` take a job id (a folder in the run
root, ``runtime.run_dir`` by default) or the path of a run folder.

A job's ``job.json`` (written by the launcher, local or SSH) holds its processes and its
endpoints: ``info["bus"]`` (the coordinator's ROUTER), ``info["pub"]`` (its PUB, what ``top``
reads) and ``info["metrics"]`` (its Prometheus ``/metrics`` URL). The launcher's run folder holds
every key of the job (``keys/``), the operator's pair among them, so a CLI client on the
launcher's machine (``top``, ``rebalance``) joins the bus as the operator.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiderl.launch.local import JOB_FILE, JobRecord, LaunchError
from tiderl.profile.sections import RuntimeConfig
from tiderl.runtime.lineage import EVENTS_FILE, live_lineage

DEFAULT_RUN_ROOT = Path(RuntimeConfig().run_dir)


def job_dir(job: str, run_root: Path | None = None) -> Path:
    """The run folder of ``job``: a path to a run folder, or a job id under ``run_root``."""
    as_path = Path(job)
    if (as_path / JOB_FILE).exists():
        return as_path
    folder = (run_root or DEFAULT_RUN_ROOT) / job
    if not (folder / JOB_FILE).exists():
        raise LaunchError(f"no job {job!r} in {run_root or DEFAULT_RUN_ROOT}/ "
                          f"(no {folder / JOB_FILE})")
    return folder


def resolve_job(job: str, run_root: Path | None = None) -> JobRecord:
    return JobRecord.load(job_dir(job, run_root))


def list_jobs(run_root: Path | None = None) -> list[JobRecord]:
    """Every job in ``run_root``, oldest first; folders without a readable job.json are skipped."""
    root = run_root or DEFAULT_RUN_ROOT
    jobs = []
    for path in sorted(root.glob(f"*/{JOB_FILE}")) if root.is_dir() else []:
        try:
            jobs.append(JobRecord.load(path.parent))
        except LaunchError:
            continue
    return sorted(jobs, key=lambda job: job.created)


def job_file(job: JobRecord, name: str, nodes: dict | None = None) -> Path:
    """A file the coordinator writes into its run folder (``metrics.jsonl``, ``events.jsonl``,
    ``report.md``), as a local path: an SSH job's is fetched from the coordinator's node first
    (over ``nodes[host]`` when the caller has the sessions open; while that node has it; the
    launcher fetches it at the job's end too). Raises ``LaunchError`` when it does not exist
    (yet)."""
    path = Path(job.run_dir) / name
    coordinator = next((r for r in job.processes if r.kind == "coordinator"), None)
    if job.info.get("nodes") and coordinator is not None:
        from tiderl.launch.ssh import session_for

        remote = f"{coordinator.run_dir}/{name}"
        try:
            if nodes and coordinator.host in nodes:
                nodes[coordinator.host].fetch(remote, path)
            else:
                with session_for(job.info, coordinator.host) as session:
                    session.fetch(remote, path)
        except LaunchError:
            if not path.exists():  # else: the copy fetched at the job's end
                raise
    if not path.exists():
        raise LaunchError(f"job {job.job_id} has no {name} yet ({path})")
    return path


def last_stop(run_dir: Path) -> dict:
    """The job's last ``stop`` event ({} if it has none: it never got that far, or its
    coordinator was killed)."""
    try:
        return last_stop_in((Path(run_dir) / EVENTS_FILE).read_text())
    except OSError:
        return {}


def last_stop_in(events: str) -> dict:
    """The last ``stop`` event of an events.jsonl's text in its live lineage ({} if none: a
    stop before a resume is of the run the resume discarded)."""
    rows = []
    for line in events.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(event, dict):
            rows.append(event)
    stops = [e for e in live_lineage([], rows).events if e.get("kind") == "stop"]
    return stops[-1] if stops else {}
