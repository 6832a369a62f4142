"""A run folder's live lineage: the step records and events of the run its model descends from.

A resumed job appends to ``metrics.jsonl`` and ``events.jsonl``. What the job before it did
after the checkpoint it resumed from stays in the files, but the run went on from the
checkpoint: that stretch is a discarded lineage. Two events mark it:

    checkpoint {version}    written once the boundary that started checkpoint ``version`` is
                            out (after that boundary's role changes and replies)
    resume {version, metrics_lines, elapsed_s, ...}
                            the resumed job's first: it goes on from checkpoint ``version``;
                            metrics.jsonl held ``metrics_lines`` records when it started

    events.jsonl   launch .. checkpoint 2 .. trained 2 .. stop | resume 2 .. trained 2 .. stop
                                         └──── discarded ─────┘
    metrics.jsonl  step 0, 1, 2, 3 | step 2, 3, 4, 5            (metrics_lines 4)
                              └──┘ discarded: before the resume, of a step >= 2

A resume cuts the events after the last ``checkpoint`` event of its version (where there is
none, as when the coordinator died between the checkpoint and its event, those later than the
checkpoint's ``elapsed_s``), and the records written before it of a step its checkpoint had not
trained (step >= version: step s makes version s + 1). A later resume cuts what is live at
its place, so a lineage discarded inside another one goes with it. A resume event without
``metrics_lines`` (a run folder written before it was recorded) cuts no step record.

:func:`read_lineage` is how every reader takes the two files in: the report, ``tiderl status``,
``tiderl measure readiness``, the launcher's exit status of a job (its last ``stop``), the
benchmarks, and :mod:`.group_fates`. ``tiderl top`` reads none of them: its snapshots come
from the step controller, whose records a resume restores from the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiderl.core.records import StepRecord

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"

Row = dict[str, Any]


class ReportError(ValueError):
    """A run file that cannot be read (metrics.jsonl, events.jsonl), or a report.md that cannot
    be written; the message is one line naming the file (and line)."""


@dataclass(frozen=True)
class Lineage:
    """The live records and events of a run folder, and how many of each it left out."""

    metrics: list[StepRecord]
    events: list[Row]
    num_discarded_records: int
    num_discarded_events: int


def read_lineage(run_dir: Path) -> Lineage:
    """The live lineage of ``run_dir``'s metrics.jsonl and events.jsonl (either may be missing:
    nothing of it). ReportError naming the file and line for a line that cannot be read."""
    run_dir = Path(run_dir)
    return live_lineage(read_records(run_dir / METRICS_FILE), read_jsonl(run_dir / EVENTS_FILE))


def live_lineage(records: list[StepRecord], events: list[Row]) -> Lineage:
    """What is live of ``records`` and ``events`` (the two files' lines, in file order)."""
    live_records: list[StepRecord] = []
    live_events: list[Row] = []
    placed = 0  # records[:placed] were written before the last resume read
    for event in events:
        version = event.get("version")
        if event.get("kind") == "resume" and isinstance(version, int):
            written = max(placed, event.get("metrics_lines", placed))
            live_records = [r for r in (*live_records, *records[placed:written])
                            if r.step < version]
            placed = written
            live_events = live_events[:_cut(live_events, event)]
        live_events.append(event)
    live_records += records[placed:]
    return Lineage(live_records, live_events, len(records) - len(live_records),
                   len(events) - len(live_events))


def read_jsonl(path: Path) -> list[Row]:
    """The JSON objects of `path`, one per non-blank line; [] when the file is missing. A last
    line without its newline that does not parse is one being written (or cut short by a
    kill): not there yet."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows: list[Row] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and not text.endswith("\n"):
                break
            raise ReportError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ReportError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def read_records(path: Path) -> list[StepRecord]:
    """The step records of a metrics.jsonl, every line of it (not its live lineage: that is
    :func:`read_lineage`); [] when the file is missing."""
    records = []
    for lineno, row in enumerate(read_jsonl(path), start=1):
        try:
            records.append(StepRecord.from_dict(row))
        except (TypeError, ValueError) as exc:
            raise ReportError(f"{path}: record {lineno}: {exc}") from None
    return records


def count_rows(path: Path) -> int:
    """The non-blank lines of ``path`` (0 when it is missing): the rows :func:`read_jsonl`
    reads from it once each ends with its newline; what a resume event's ``metrics_lines``
    counts."""
    if not path.exists():
        return 0
    with path.open() as lines:
        return sum(1 for line in lines if line.strip())


def _cut(live: list[Row], resume: Row) -> int:
    """How many of the live events a resume keeps: those up to its checkpoint's event."""
    version = resume["version"]
    for index in range(len(live) - 1, -1, -1):
        if live[index].get("kind") == "checkpoint" and live[index].get("version") == version:
            return index + 1
    elapsed = resume.get("elapsed_s", float("inf"))
    return sum(1 for event in live if event.get("time_s", 0.0) <= elapsed)
