"""ERS's predictive planner (``ers.planner: predictive``): the rollout/trainer split the
measured per-rank rates say trains fastest, instead of the rules' one-rank nudges.

    the steps since the layout last changed ──rate_window──> RateWindow: trained tokens C over
        the span; rollout rank-seconds saturated (tasks waited for admission: every rank full);
        trainer rank-seconds busy (its ranks' time less TWT)
    supply s = C / saturated rollout rank-seconds      (inf: rollout capacity never bound it)
    demand d = C / busy trainer rank-seconds
    g = the share of placed tasks' time spent generating (the rest waits for environments)
    with n of the N movable ranks on rollout (n0 measured):  G(n) = min(n·s, (N − n)·d, L(n))

Each side's rate is what one rank of it delivers while it is the bound; the side with slack
would deliver more. L is the latency bound: when neither side's capacity at the measured split
comes within the margin of the goodput X seen, something else held the pipeline. In an agentic
job that is the staleness window over the tasks' latency (every allowed task was placed, and
generating or waiting for its tool), and by Little's law goodput is the window over that
latency. Its generating part is spread over the rollout ranks, so with n ranks it takes n0/n of
the time: L(n) = X / ((1 − g) + g·n0/n). Otherwise L is unbounded.

The model is linear in each side's ranks: it holds while a rank adds the same capacity (rollout
ranks place tasks in parallel up to their KV budget and share the decoding; data-parallel
trainer ranks split a batch). Decoding that is memory-bound gains less from a smaller batch than
n0/n. It does not model a step's fixed costs (the optimizer step, the weight sync), ranks that
share cores, nor how a split changes staleness discards: a planned move goes on trial like a
rule's move and is reverted when the steps after it train slower (``ers._judge``), which is what
catches those.

Pure: no clock, no I/O; the simulator and the runtime feed it the same StepRecords.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.core.records import StepRecord


@dataclass(frozen=True, slots=True)
class RateWindow:
    """The trailing steps that ran on one layout (``num_rollout`` and ``num_trainer`` ranks):
    what they trained over their span, the rollout rank-seconds saturated and the trainer
    rank-seconds busy."""

    num_steps: int
    num_rollout: int
    num_trainer: int
    trained_tokens: int
    span_s: float
    rollout_saturated_s: float
    trainer_busy_s: float
    generating_share: float = 0.0  # g, over the window's placed task-seconds

    @property
    def goodput(self) -> float:
        return self.trained_tokens / self.span_s

    @property
    def supply_per_rank(self) -> float:
        """Trained tokens one saturated rollout rank produced per second (inf: none was)."""
        if self.rollout_saturated_s <= 0:
            return math.inf
        return self.trained_tokens / self.rollout_saturated_s

    @property
    def demand_per_rank(self) -> float:
        """Trained tokens one busy trainer rank consumed per second."""
        return self.trained_tokens / self.trainer_busy_s

    def capacity(self, num_rollout: int, num_trainer: int) -> float:
        """min(n·s, T·d): what the slower side would deliver with these rank counts."""
        return min(num_rollout * self.supply_per_rank, num_trainer * self.demand_per_rank)

    def latency_bound(self, num_rollout: int, margin: float) -> float:
        """L(n): when its own split's capacity exceeded the window's goodput by more than
        ``margin`` (neither side bound it), that goodput with the generating share of the
        tasks' latency scaled by n0/n; else inf."""
        if self.capacity(self.num_rollout, self.num_trainer) <= self.goodput * (1.0 + margin):
            return math.inf
        g = self.generating_share
        return self.goodput / ((1.0 - g) + g * self.num_rollout / max(1, num_rollout))


def same_roles_run(records: Sequence[StepRecord], max_steps: int) -> list[int]:
    """Indices of the last ``max_steps`` records in a row that ran on the last record's roles,
    newest first (none for no records)."""
    run: list[int] = []
    for i in range(len(records) - 1, -1, -1):
        if len(run) == max_steps or records[i].roles != records[-1].roles:
            break
        run.append(i)
    return run


def rate_window(records: Sequence[StepRecord], max_steps: int) -> RateWindow | None:
    """The last ``max_steps`` steps with the last step's roles, in a row, step 0 left out (its
    span holds the launch's whole rollout); None when there is none, the trainer never worked
    or a record lacks the saturated time."""
    if not records or max_steps < 1:
        return None
    last = records[-1]
    trained, span, saturated, trainer_busy, generating, num = 0, 0.0, 0.0, 0.0, 0.0, 0
    for i in same_roles_run(records, max_steps):
        r = records[i]
        if i == 0 or r.rollout_saturated_s is None:
            break
        step_span = r.end_s - records[i - 1].end_s
        trained += r.trained_tokens
        span += step_span
        saturated += r.rollout_saturated_s
        generating += (r.generating_share or 0.0) * step_span
        trainer_busy += max(0.0, r.num_trainer * step_span - r.twt_s)
        num += 1
    if not num or trained <= 0 or span <= 0 or trainer_busy <= 0:
        return None
    return RateWindow(num, last.num_rollout, last.num_trainer, trained, span, saturated,
                      trainer_busy, generating / span)


def predicted_goodput(num_rollout: int, num_movable: int, window: RateWindow, *,
                      margin: float) -> float:
    """G(n) = min(n·s, (N − n)·d, L(n)) for ``num_rollout`` of ``num_movable`` ranks on
    rollout."""
    return min(window.capacity(num_rollout, num_movable - num_rollout),
               window.latency_bound(num_rollout, margin))


def planned_rollout_ranks(num_rollout: int, num_movable: int, window: RateWindow, *,
                          lo: int, hi: int, max_moves: int, margin: float) -> int:
    """The number of rollout ranks to run next: the split in [lo, hi] within ``max_moves`` of
    ``num_rollout`` with the highest predicted goodput (the nearer one on a tie), kept only if
    it beats the current split's prediction by more than ``margin`` (a move costs a weight sync
    and the KV cache of the tasks on a rank that leaves rollout)."""
    lo, hi = max(lo, num_rollout - max_moves), min(hi, num_rollout + max_moves)
    if lo > hi:
        return num_rollout

    def predicted(n: int) -> float:
        return predicted_goodput(n, num_movable, window, margin=margin)

    best = max(range(lo, hi + 1), key=lambda n: (predicted(n), -abs(n - num_rollout)))
    return best if predicted(best) > predicted(num_rollout) * (1.0 + margin) else num_rollout
