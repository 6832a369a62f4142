"""One benchmark job: a real ``tiderl launch`` of the local profile with overrides, its records."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tiderl.core.records import StepRecord
from tiderl.launch.job import run_local
from tiderl.profile import load_profile
from tiderl.runtime.lineage import read_lineage
from tiderl.runtime.report import summarize


@dataclass(frozen=True)
class JobRun:
    run_dir: Path
    metrics: list[StepRecord]
    summary: dict
    job_s: float  # wall time of the launch, start-up and report included


def run_job(name: str, overrides: list[str], steps: int, root: Path, note) -> JobRun:
    """Run the local profile with ``overrides`` for ``steps`` steps as job ``name`` under
    ``root``; SystemExit naming its logs if it fails."""
    profile = load_profile("local", [*overrides, f"job.steps={steps}"])
    note(f"{name}: {steps} steps ...")
    start = time.monotonic()
    job = run_local(profile, run_root=root, job_id=name)
    if job.exit_code != 0:
        raise SystemExit(f"{name}: the job failed (see {job.run_dir}/logs)")
    metrics = read_lineage(job.run_dir).metrics
    return JobRun(job.run_dir, metrics, summarize(metrics), round(time.monotonic() - start, 1))
