"""Resume: the step cycle's state at a checkpoint's boundary, and the cycle rebuilt from it.

    Boundary(version v, checkpoint) ──resume_point()──> ResumePoint (beside the actors' shards)
    tiderl launch --resume ──restore(point, ready groups)──> Boundary v (weights of v to every
                                                             rank; rollout ranks join after it)

A checkpoint is taken at the boundary after step v - 1, when no step is open. What each group is
at that instant decides what the resumed job does with it:

- trained (in a batch below v): never fed again;
- ready (finished, in the buffer, not trained): restored with its samples, in ready order, so
  it fills batch v and on exactly as it would have;
- in flight (fed, not every task finished): run again from its first turn. Its environment
  sessions and KV died with the job, and its finished siblings' samples alone cannot train (a
  GRPO group's advantages need every task), so re-running it is the one way it is not skipped;
  it was never trained, so it is not trained twice;
- evaluation groups in flight are not restored: evaluation is not training data, and the next
  phase due runs as scheduled.

The dataset is a function of the group index (:class:`tiderl.runtime.groups.Dataset`), so a
group run again draws the same environment and seed, and the feed goes on at ``num_fed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiderl.core.buffer import Discarded, ReadyGroup
from tiderl.core.commands import GroupSpec
from tiderl.core.ers_state import ERSState
from tiderl.core.records import StepRecord
from tiderl.core.step_control.config import StepControlError
from tiderl.core.step_control.state import GroupCount, Phase
from tiderl.core.types import Placement, Role

if TYPE_CHECKING:
    from tiderl.core.commands import Command
    from tiderl.core.step_control.controller import StepController


@dataclass(frozen=True)
class ResumePoint:
    """The step cycle at the boundary of ``version`` (== the steps done)."""

    version: int
    elapsed_s: float  # the job's clock at the boundary: the resumed job's times go on from it
    roles: tuple[Role, ...]
    num_fed: int
    ready: tuple[str, ...]  # ready groups, in ready order
    in_flight: tuple[GroupSpec, ...]  # training groups to run again
    trained_tokens: int
    trained_samples: int
    failed_samples: int
    num_retired: int
    discarded_tokens: int
    discarded_groups: int
    discarded_samples: int
    generated_tokens: int
    tasks_per_step: int
    placement: Placement
    eval_fed_at: int
    groups: GroupCount
    records: tuple[StepRecord, ...] = ()
    ers: ERSState | None = None
    rank_budgets: dict[int, int] = field(default_factory=dict)


def resume_point(ctl: StepController, now: float) -> ResumePoint:
    """The state to resume from at the boundary just emitted (no step is open)."""
    st, buffer, feed, ledger = ctl.state, ctl.buffer, ctl.feed, ctl.ledger
    if ctl.steps.current is not None:
        raise StepControlError(f"step {st.step} is open: a resume point is a boundary's")
    ready: dict[str, None] = {}  # assigned to a batch (not consumed), then pending
    for group in (*buffer.group_of_seq.values(), *buffer.pending):
        ready.setdefault(group.group_id)
    count = feed.count
    # an idle rank is one that died: a resumed job starts it again, as a rollout rank
    roles = tuple(Role.ROLLOUT if r is Role.IDLE else r for r in st.roles)
    return ResumePoint(
        version=st.version, elapsed_s=now - st.t0, roles=roles, num_fed=feed.num_fed,
        ready=tuple(ready), in_flight=tuple(feed.out.values()),
        trained_tokens=ledger.trained_tokens, trained_samples=ledger.trained_samples,
        failed_samples=feed.failed_samples, num_retired=ctl.rollout.book.num_retired_train,
        discarded_tokens=buffer.discarded.tokens, discarded_groups=buffer.discarded.groups,
        discarded_samples=buffer.discarded.samples,
        generated_tokens=ctl.rollout.generated_tokens,
        tasks_per_step=ctl.rollout.book.tasks_per_step,
        placement=st.placement, eval_fed_at=ctl.evaluation.fed_at,
        groups=GroupCount(count.fed, count.ready, set(count.trained_ids), count.stale,
                          count.failed),
        records=tuple(ledger.records), ers=ctl.ers.state if ctl.ers is not None else None,
        rank_budgets=dict(ctl.rollout.rank_budgets))


def restore(ctl: StepController, point: ResumePoint, ready: Sequence[ReadyGroup],
            now: float) -> list[Command]:
    """Launch ``ctl`` (a new controller of the same config) from ``point``; ``ready`` are the
    point's ready groups with their samples, in its order. Returns the launch's commands."""
    st = ctl.state
    if st.phase is not Phase.LAUNCHING:
        raise StepControlError("restore() replaces launch(): the controller has launched")
    if [g.group_id for g in ready] != list(point.ready):
        raise StepControlError("the ready groups do not match the resume point's")
    if len(point.roles) != len(st.roles):
        raise StepControlError(f"the checkpoint has {len(point.roles)} ranks, the job "
                               f"{len(st.roles)}")
    st.t0 = now - point.elapsed_s
    st.trainer_free_at = now
    st.step = st.version = point.version
    st.roles = list(point.roles)
    st.placement = point.placement
    ledger = ctl.ledger
    ledger.records = list(point.records)
    ledger.trained_tokens, ledger.trained_samples = point.trained_tokens, point.trained_samples
    g = point.groups
    # the ready ones count again as they are added back; the last step's samples leave the
    # window at this boundary (their retirement waited for the rollout ranks' new weights)
    ctl.feed.count = GroupCount(g.fed, g.ready - len(point.ready), set(g.trained_ids), g.stale,
                                g.failed)
    ctl.feed.num_fed = point.num_fed
    ctl.evaluation.fed_at = point.eval_fed_at
    if ctl.ers is not None and point.ers is not None:
        ctl.ers.state = point.ers
    rollout = ctl.rollout
    rollout.restart_clock(now)
    rollout.generated_tokens = point.generated_tokens
    rollout.rank_budgets.update(point.rank_budgets)
    book = ctl.rollout.book
    book.retire(point.num_retired)
    book.set_tasks_per_step(point.tasks_per_step)
    # every task fed and not in flight has been admitted once: trained, dropped, or ready
    book.window.num_admitted = (point.num_fed - len(point.in_flight)) * ctl.config.job.group_size
    buffer = ctl.buffer
    buffer.open_batch = point.version
    buffer.discarded = Discarded(point.discarded_groups, point.discarded_samples,
                                 point.discarded_tokens)
    ctl.tracker.start_step(now)
    st.to(Phase.BOUNDARY)
    return ctl.restore_boundary(ready, point.in_flight, now)
