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


def split_overrides(text: str) -> list[str]:
    """``a=1,b=[x,y]`` -> ``["a=1", "b=[x,y]"]``: commas inside brackets or braces belong to a
    list or mapping value."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part for part in parts if part]


def parse_variants(specs: list[str], is_taken) -> dict[str, list[str]]:
    """``--variant NAME=OVERRIDE[,OVERRIDE]`` values -> {name: overrides}; a ValueError names a
    spec without a name or overrides, or whose name ``is_taken`` (a run of the bench's own) or
    repeats."""
    variants: dict[str, list[str]] = {}
    for spec in specs:
        name, _, overrides = spec.partition("=")
        if not name or not overrides or is_taken(name) or name in variants:
            raise ValueError(f"--variant {spec!r}: expected NAME=OVERRIDE[,OVERRIDE] with a new "
                             "name")
        variants[name] = split_overrides(overrides)
    return variants
