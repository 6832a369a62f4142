"""What a job tells the outside: metrics.jsonl, events.jsonl, the PUB snapshots ``tiderl top``
reads and the Prometheus exporter's values (:mod:`tiderl.runtime.prom`).

    StepRecord (from the step controller) ──> metrics.jsonl line, exporter.update_step, Snapshot,
                                              its numbers to each writer of logging.backends
                                              (TensorBoard, wandb: runtime/log_backends.py)
    every SNAPSHOT_S ──> Snapshot (the last record, CTB's counts and budgets, rank gauges), and
                         exporter.update_live
    events ──> events.jsonl (launch, role changes, evaluations, dropped groups, dead ranks, ...;
               a replayed step's loss beside its recorded one; the checkpoint and resume events
               that mark what a resume discarded: runtime/lineage.py)

Every number comes from the controller's :class:`StepRecord` or its queries; the run folder and
the clock are given (the coordinator's daemon passes the job's folder and ``time.monotonic``).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tiderl.core.records import StepRecord
from tiderl.core.step_control import StepController
from tiderl.runtime import bus as b
from tiderl.runtime.lineage import EVENTS_FILE, METRICS_FILE, count_rows

if TYPE_CHECKING:
    from tiderl.runtime.log_backends import StepWriter
    from tiderl.runtime.prom import MetricsExporter

log = logging.getLogger("tiderl.coordinator")

SNAPSHOT_S = 0.5


class EventThrottle:
    """Events of one kind and key at most once per ``every_s`` (a flood of bad messages must not
    flood events.jsonl), each with the count of those held back since the last."""

    def __init__(self, emit: Callable[..., None], every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.emit, self.every_s, self.clock = emit, every_s, clock
        self._quiet_until: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def event(self, kind: str, key: str, **fields: object) -> None:
        slot, now = (kind, key), self.clock()
        if now < self._quiet_until.get(slot, float("-inf")):
            self._held[slot] = self._held.get(slot, 0) + 1
            return
        if len(self._quiet_until) > 1024:  # bound what a key-cycling sender can take
            self._quiet_until.clear()
            self._held.clear()
        self._quiet_until[slot] = now + self.every_s
        self.emit(kind, **fields, repeats=self._held.pop(slot, 0))


def numbers(row: dict[str, object]) -> dict[str, float]:
    """The numeric values of a metrics.jsonl line (not its strings, lists, nulls or bools)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def drop_unfinished_line(path: Path) -> None:
    """Cut a last line without its newline off ``path``: what a killed job (or a full disk)
    left of a line it was writing. Appended to, it would make the next line unreadable."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as handle, mmap.mmap(handle.fileno(), 0) as data:
        if data[-1:] == b"\n":
            return
        keep = data.rfind(b"\n") + 1
        log.warning("%s: dropped an unfinished last line (%d bytes)", path, len(data) - keep)
    os.truncate(path, keep)


class RunLog:
    def __init__(self, run_dir: Path, clock: Callable[[], float],
                 exporter: MetricsExporter | None = None,
                 writers: Sequence[StepWriter] = ()) -> None:
        self.run_dir, self.clock, self.exporter = Path(run_dir), clock, exporter
        self.writers = list(writers)  # logging.backends other than jsonl
        self.t0 = clock()
        self.rank_metrics: dict[int, b.RankMetrics] = {}
        self.last_snapshot = float("-inf")
        for name in (METRICS_FILE, EVENTS_FILE):
            drop_unfinished_line(self.run_dir / name)
        # a resumed job's resume event names it: the records before are of the run it resumed
        self.num_prior_records = count_rows(self.run_dir / METRICS_FILE)
        self.metrics_file = open(self.run_dir / METRICS_FILE, "a")  # noqa: SIM115
        self.events_file = open(self.run_dir / EVENTS_FILE, "a")  # noqa: SIM115
        self.throttle = EventThrottle(self.event)  # events a sender could flood

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def event(self, kind: str, **fields: object) -> None:
        line = {"time_s": round(self.elapsed(), 3), "kind": kind, **fields}
        self.events_file.write(json.dumps(line) + "\n")
        self.events_file.flush()
        log.info("event %s", line)

    def kv_counters(self) -> tuple[int, int]:
        """Prompt tokens looked up in, and found in, every rollout rank's prefix cache."""
        metrics = self.rank_metrics.values()
        return sum(m.prefix_queries for m in metrics), sum(m.prefix_hits for m in metrics)

    def record(self, record: StepRecord, controller: StepController, note: str) -> b.Snapshot:
        """A step's line, then its numbers to the other backends; the exporter first (once a
        step is in the file, /metrics has it)."""
        if self.exporter is not None:
            self.exporter.update_step(
                trained_tokens_total=record.trained_tokens_total,
                twt_s_total=sum(r.twt_s for r in controller.ledger.records),
                kv_hit_rate=record.kv_hit_rate, staleness=record.staleness_max,
                step_mode=record.step_mode.value)
        row = record.to_dict()
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        values = {k: v for k, v in numbers(row).items() if k != "step"}  # step: the x axis
        for writer in self.writers:
            writer.write(record.step, values)
        if record.recorded_loss is not None:  # a replayed step: both losses, unrounded
            loss, recorded = record.loss, record.recorded_loss
            self.event("replayed", step=record.step, loss=loss, recorded_loss=recorded,
                       difference=None if loss is None else loss - recorded)
        return self.snapshot(controller, note)

    def snapshot(self, controller: StepController, note: str) -> b.Snapshot:
        self.last_snapshot = self.clock()
        last = controller.ledger.records[-1] if controller.ledger.records else None
        metrics = numbers(last.to_dict()) if last is not None else {}
        book = controller.rollout.book
        metrics.update(steps=float(controller.config.job.steps), elapsed_s=self.elapsed(),
                       active=float(book.num_active), paused=float(book.num_paused),
                       new=float(book.num_new))
        if self.exporter is not None:
            self._export_live(controller)
        return b.Snapshot(
            step=controller.state.step, time=self.elapsed(),
            roles={r: role.value for r, role in enumerate(controller.state.roles)}, metrics=metrics,
            ranks=[self.rank_metrics[r] for r in sorted(self.rank_metrics)],
            step_mode=last.step_mode.value if last is not None else "", note=note,
            ctb_budgets=controller.rollout.budgets())

    def is_snapshot_due(self) -> bool:
        return self.clock() - self.last_snapshot >= SNAPSHOT_S

    def _export_live(self, controller: StepController) -> None:
        assert self.exporter is not None
        signals = controller.tracker.signals(self.clock())
        rollout = set(controller.rollout_ranks())
        self.exporter.update_live(
            rwt_s_total=controller.rollout.rwt.total, ras=signals.ras, tprm_s=signals.tprm_s,
            roles=[role.value for role in controller.state.roles],
            ctb_budgets=controller.rollout.budgets(),
            kv_tokens={r: (m.kv_tokens_used, m.kv_tokens_capacity)
                       for r, m in self.rank_metrics.items() if r in rollout})

    def close(self) -> None:
        self.metrics_file.close()
        self.events_file.close()
        for writer in self.writers:
            writer.close()
