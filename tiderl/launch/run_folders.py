"""Run folders: finding a job and the files its coordinator writes. ``tiderl status | logs |
stop | top | rebalance | profile`` and ``launch --resume`` take a job id (a folder in the run
root, ``runtime.run_dir`` by default) or the path of a run folder.

A new job's folder is made at once by :func:`new_run_dir` (``mkdir``, atomic), so two launches
into one run root never share one; its id is the start time to the millisecond and the system
(``20261206-091925-123-sync``): ids sort in launch order.

A job's ``job.json`` (written by the launcher, local or SSH) holds its processes and its
endpoints: ``info["bus"]`` (the coordinator's ROUTER), ``info["pub"]`` (its PUB, what ``top``
reads) and ``info["metrics"]`` (its Prometheus ``/metrics`` URL). The launcher's run folder holds
every key of the job (``keys/``), the operator's pair among them, so a CLI client on the
launcher's machine (``top``, ``rebalance``) joins the bus as the operator.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path

from tiderl.core.quote import cut, short
from tiderl.launch.local import JOB_FILE, JobRecord, LaunchError, LaunchRefused
from tiderl.profile.sections import RuntimeConfig
from tiderl.runtime.lineage import EVENTS_FILE, live_lineage

DEFAULT_RUN_ROOT = Path(RuntimeConfig().run_dir)


def job_id_at(time_ms: int, system: str) -> str:
    """The id of a job of ``system`` started at ``time_ms`` (ms since the epoch), in local time:
    ``20261206-091925-123-sync``; fixed width up to the system, so ids sort by time."""
    stamp = datetime.fromtimestamp(time_ms / 1000)
    return f"{stamp:%Y%m%d-%H%M%S}-{time_ms % 1000:03d}-{system}"


def new_run_dir(run_root: Path, system: str, job_id: str | None = None,
                now: float | None = None) -> Path:
    """Make the run folder of a new job in ``run_root`` and return it; its name is the job id.
    ``mkdir`` makes it or fails, so no two launches get one folder: without ``job_id``, one
    made meanwhile (a launch in the same millisecond) moves the id on by a millisecond, which
    keeps ids unique and in launch order; a given ``job_id`` already there is refused.
    ``now``: the start time (seconds since the epoch; the clock's by default). LaunchRefused,
    in one line, when the run root cannot hold it."""
    time_ms = round((time.time() if now is None else now) * 1000)
    try:
        run_root.mkdir(parents=True, exist_ok=True)
        folder = _first_free_folder(run_root, system, job_id, time_ms)
    except OSError as exc:  # not writable, a file in the way, ...
        raise LaunchRefused(f"cannot make a run folder in {cut(str(run_root))}: "
                            f"{exc.strerror or exc}") from None
    if folder is None:
        raise LaunchRefused(f"run folder {cut(str(run_root / str(job_id)))} exists (a job id "
                            "names one job; choose another)")
    return folder


def _first_free_folder(run_root: Path, system: str, job_id: str | None,
                       time_ms: int) -> Path | None:
    """Makes the folder of ``job_id``, or of the first id from ``time_ms`` on that is free;
    None when ``job_id`` is taken."""
    while True:
        folder = run_root / (job_id or job_id_at(time_ms, system))
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            if job_id:
                return None
            time_ms += 1


@contextmanager
def kept_if_used(run_dir: Path) -> Iterator[Path]:
    """Removes ``run_dir`` again when the block fails before writing anything into it (a launch
    refused after its folder was made leaves no empty folder behind)."""
    try:
        yield run_dir
    except BaseException:
        with suppress(OSError):  # not empty: it stays
            run_dir.rmdir()
        raise


def job_dir(job: str, run_root: Path | None = None) -> Path:
    """The run folder of ``job``: a path to a run folder, or a job id under ``run_root``."""
    as_path = Path(job)
    if _has_job_file(as_path):
        return as_path
    folder = (run_root or DEFAULT_RUN_ROOT) / job
    if not _has_job_file(folder):
        raise LaunchError(f"no job {short(job)} in {run_root or DEFAULT_RUN_ROOT}/ "
                          f"(no {cut(str(folder / JOB_FILE))})")
    return folder


def _has_job_file(folder: Path) -> bool:
    """Whether ``folder`` holds a job.json; False for a name the system refuses (too long)."""
    try:
        return (folder / JOB_FILE).exists()
    except OSError:
        return False


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
