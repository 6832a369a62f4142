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

The dataset is a function of the group index (:class:`tiderl.runtime.records.Dataset`), so a
group run again draws the same environment and seed, and the feed goes on at ``num_fed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiderl.core.buffer import ReadyGroup
from tiderl.core.commands import FeedGroups, GroupSpec
from tiderl.core.ers_state import ERSState
from tiderl.core.records import StepRecord
from tiderl.core.step_control.config import StepControlError
from tiderl.core.step_control.state import GroupCount, Phase
from tiderl.core.types import Mode, Role

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
    ra2p_mode: Mode
    eval_fed_at: int
    groups: GroupCount
    records: tuple[StepRecord, ...] = ()
    ers: ERSState | None = None
    rank_budgets: dict[int, int] = field(default_factory=dict)


def resume_point(ctl: StepController, now: float) -> ResumePoint:
    """The state to resume from at the boundary just emitted (no step is open)."""
    if ctl.current is not None:
        raise StepControlError(f"step {ctl.step} is open: a resume point is a boundary's")
    buffer = ctl.buffer
    ready: dict[str, None] = {}  # assigned to a batch (not consumed), then pending
    for group in (*buffer.group_of_seq.values(), *buffer.pending):
        ready.setdefault(group.group_id)
    groups = ctl.groups
    # an idle rank is one that died: a resumed job starts it again, as a rollout rank
    roles = tuple(Role.ROLLOUT if r is Role.IDLE else r for r in ctl.roles)
    return ResumePoint(
        version=ctl.version, elapsed_s=now - ctl.t0, roles=roles, num_fed=ctl.num_fed,
        ready=tuple(ready), in_flight=tuple(ctl.fed_specs.values()),
        trained_tokens=ctl.trained_tokens, trained_samples=ctl.trained_samples,
        failed_samples=ctl.failed_samples, num_retired=ctl.num_retired,
        discarded_tokens=buffer.discarded_tokens, discarded_groups=buffer.discarded_groups,
        discarded_samples=buffer.discarded_samples,
        generated_tokens=ctl.rollout.generated_tokens, tasks_per_step=ctl.book.tasks_per_step,
        ra2p_mode=ctl.ra2p_mode, eval_fed_at=ctl.evaluation.fed_at,
        groups=GroupCount(groups.fed, groups.ready, set(groups.trained_ids), groups.stale,
                          groups.failed),
        records=tuple(ctl.records), ers=ctl.ers.state if ctl.ers is not None else None,
        rank_budgets=dict(ctl.rollout.rank_budgets))


def restore(ctl: StepController, point: ResumePoint, ready: Sequence[ReadyGroup],
            now: float) -> list[Command]:
    """Launch ``ctl`` (a new controller of the same config) from ``point``; ``ready`` are the
    point's ready groups with their samples, in its order. Returns the launch's commands."""
    if ctl.phase is not Phase.LAUNCHING:
        raise StepControlError("restore() replaces launch(): the controller has launched")
    if [g.group_id for g in ready] != list(point.ready):
        raise StepControlError("the ready groups do not match the resume point's")
    if len(point.roles) != len(ctl.roles):
        raise StepControlError(f"the checkpoint has {len(point.roles)} ranks, the job "
                               f"{len(ctl.roles)}")
    ctl._at(now)
    ctl.t0 = now - point.elapsed_s
    ctl.trainer_free_at = now
    ctl.step = ctl.version = point.version
    ctl.roles = list(point.roles)
    ctl.records = list(point.records)
    ctl.trained_tokens, ctl.trained_samples = point.trained_tokens, point.trained_samples
    ctl.failed_samples, ctl.num_retired = point.failed_samples, point.num_retired
    ctl.is_retire_pending = True  # the last step's samples leave the window at this boundary
    ctl.num_fed = point.num_fed
    ctl.ra2p_mode = point.ra2p_mode
    ctl.evaluation.fed_at = point.eval_fed_at
    g = point.groups
    ctl.groups = GroupCount(g.fed, g.ready - len(point.ready), set(g.trained_ids), g.stale,
                            g.failed)  # the ready ones count again as they are added back
    if ctl.ers is not None and point.ers is not None:
        ctl.ers.state = point.ers
    rollout = ctl.rollout
    rollout.restart_clock(now)
    rollout.generated_tokens = point.generated_tokens
    rollout.rank_budgets.update(point.rank_budgets)
    book = ctl.book
    book.retire(point.num_retired)
    book.set_tasks_per_step(point.tasks_per_step)
    # every task fed and not in flight has been admitted once: trained, dropped, or ready
    book.num_admitted_train = (point.num_fed - len(point.in_flight)) * ctl.config.group_size
    buffer = ctl.buffer
    buffer.open_batch = point.version
    buffer.discarded_tokens, buffer.discarded_groups = (point.discarded_tokens,
                                                        point.discarded_groups)
    buffer.discarded_samples = point.discarded_samples
    ctl.tracker.start_step(now)
    ctl.phase = Phase.BOUNDARY
    # the weights of the point's version go to every rank; the rollout ranks take tasks once
    # their engines have them
    ctl._boundary(now, ctl.roles, None, is_resume=True)
    for group in ready:
        ctl.groups.ready += 1
        buffer.add_group(group, now)
    if point.in_flight:
        for spec in point.in_flight:
            ctl.fed_specs[spec.group_id] = spec
            rollout.add_group(ctl.source(spec), now)
        ctl._out.append(FeedGroups(tuple(point.in_flight), is_eval=False))
    return ctl._flush()
