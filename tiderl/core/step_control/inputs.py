"""The inputs the step cycle builds for ERS and RA2P, from what it has seen (pure functions).

    trainer ranks' RankReports ──learn_passes──> per-micro-batch pass times, per layout, with the
                                                 GPUs each pass ran on
    StepRecords ──mean step time, micro-batches per step, idle shares, rates──┐
    ReadinessTracker.signals(now) ────────────────────────────────────────────┼──> ERSInput
    layout_timings: the pass times of a layout about to run ─────────────────┴──> choose_placement

Micro-batches are cut for the step's actor ranks (``tokens_per_rank`` each), so an actor's share
of one is the same in any layout; the Ref pass's share is the micro-batch over the GPUs that run
Ref: all actor ranks colocated, the Ref ranks alone decoupled. A layout is costed with its own
last measurement, or the other layout's, the Ref time scaled by that ratio (a decoupled Ref rank
serving 24 actors takes 24 times a colocated Ref pass). With nothing measured RA2P stays
colocated and ERS sees zero pass times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from tiderl.core.commands import RankReport, StartStep
from tiderl.core.ers import ERSConfig, ERSInput
from tiderl.core.ers_predict import rate_window, same_roles_run
from tiderl.core.ers_state import Direction
from tiderl.core.job import BatchBounds
from tiderl.core.ra2p import RA2PConfig, choose_placement, synthetic_ready_times
from tiderl.core.records import StepRecord
from tiderl.core.system import StepMode
from tiderl.core.types import Placement, Ra2pTimings, ReadinessSignals, Role

NO_TIMINGS = Ra2pTimings(0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class MeasuredPasses:
    """One step's per-micro-batch pass times and the GPUs its Ref and Actor passes ran on."""

    timings: Ra2pTimings
    num_ref_gpus: int
    num_actor_gpus: int

    @property
    def ref_share(self) -> float:
        """Actor GPUs per Ref GPU: how much of a micro-batch one Ref GPU computes, relative."""
        return self.num_actor_gpus / self.num_ref_gpus


def learn_passes(reports: Sequence[RankReport], start: StartStep) -> MeasuredPasses:
    """A step's pass times, each the mean over the ranks that ran that pass."""

    def mean(name: str) -> float:
        values = [v for report in reports if (v := getattr(report, name)) is not None]
        return sum(values) / len(values) if values else 0.0

    timings = Ra2pTimings(mean("t_ref"), mean("t_act_f"), mean("t_act_b"), mean("t_swap"))
    num_actors = max(1, len(start.actor_ranks))
    is_decoupled = start.step_mode is StepMode.DECOUPLED
    return MeasuredPasses(timings, max(1, len(start.ref_ranks)) if is_decoupled else num_actors,
                          num_actors)


def layout_timings(measured: dict[Placement, MeasuredPasses], placement: Placement,
                   num_refs: int,
                   num_actors: int) -> Ra2pTimings | None:
    """The pass times of ``placement`` with ``num_refs`` Ref and ``num_actors`` actor ranks (a
    colocated layout runs Ref on the actors), from its own last measurement or the other
    layout's; None when nothing was measured."""
    other = Placement.COLOCATED if placement is Placement.DECOUPLED else Placement.DECOUPLED
    last = measured.get(placement) or measured.get(other)
    if last is None:
        return None
    num_actors = max(1, num_actors)
    ref_gpus = max(1, num_refs) if placement is Placement.DECOUPLED else num_actors
    t = last.timings
    scale = (num_actors / ref_gpus) / last.ref_share
    swaps = measured.get(Placement.COLOCATED) or last  # only a colocated step swaps
    return Ra2pTimings(t.t_ref * scale, t.t_act_f, t.t_act_b, swaps.timings.t_swap)


def mean_step_s(records: Sequence[StepRecord]) -> float:
    """T_step: the mean step duration so far (0 before the first step)."""
    return sum(r.step_s for r in records) / len(records) if records else 0.0


def last_num_micro_batches(records: Sequence[StepRecord]) -> int:
    return records[-1].num_micro_batches if records else 1


def _idle_frac(records: Sequence[StepRecord], wait_s: str, num_ranks: str, steps: int) -> float:
    """``wait_s`` rank-seconds over the ``num_ranks`` ranks' of the last ``steps`` steps that ran
    on the last step's roles (0 before the first step). One step reads too little: under a
    staleness window the trainer starves every other step and rollout idles at the full window
    in between, so a single step reads a deficit that the pair of them does not have."""
    same = [records[i] for i in same_roles_run(records, steps)]
    capacity = sum(getattr(r, num_ranks) * r.step_s for r in same)
    if capacity <= 0:
        return 0.0
    return min(1.0, sum(getattr(r, wait_s) for r in same) / capacity)


def rollout_idle_frac(records: Sequence[StepRecord], steps: int) -> float:
    """RWT over the rollout rank-seconds of the last ``steps`` steps on the last step's roles."""
    return _idle_frac(records, "rwt_s", "num_rollout", steps)


def trainer_idle_frac(records: Sequence[StepRecord], steps: int) -> float:
    """TWT over the trainer rank-seconds of the last ``steps`` steps on the last step's roles."""
    return _idle_frac(records, "twt_s", "num_trainer", steps)


def step_goodput(records: Sequence[StepRecord]) -> tuple[float, ...]:
    """Trained tokens per second of each step, from the end of the one before (boundaries
    included: a move's weight sync counts against it)."""
    out, prev_end = [], 0.0
    for r in records:
        span = r.end_s - prev_end
        out.append(r.trained_tokens / span if span > 0 else 0.0)
        prev_end = r.end_s
    return tuple(out)


def _move_direction(before: Sequence[str], after: Sequence[str]) -> Direction | str | None:
    """Which way the roles changed between two steps: None (no rank moved between rollout and
    the trainer), a direction, or "both"."""
    trainer = {Role.REF.value, Role.ACTOR.value}
    ways = {Direction.TO_TRAINER if a == Role.ROLLOUT.value else Direction.TO_ROLLOUT
            for a, b in zip(before, after, strict=False)
            if {a, b} <= trainer | {Role.ROLLOUT.value} and Role.ROLLOUT.value in {a, b} and a != b}
    return None if not ways else ways.pop() if len(ways) == 1 else "both"


def move_costs(records: Sequence[StepRecord]) -> tuple[tuple[Direction, float], ...]:
    """Per direction, the mean time a role move added to its boundary: the gap from a step's
    end to the next step's start where ranks moved that way, less the median gap where none
    moved (a direction not moved yet: absent)."""
    gaps: dict[Direction | str | None, list[float]] = {}
    for prev, rec in pairwise(records):
        gaps.setdefault(_move_direction(prev.roles, rec.roles), []).append(
            max(0.0, rec.start_s - prev.end_s))
    still = sorted(gaps.get(None, ()))
    base = still[len(still) // 2] if still else 0.0
    return tuple((d, max(0.0, sum(g) / len(g) - base)) for d in Direction if (g := gaps.get(d)))


def rate_steps(config: ERSConfig) -> int:
    """The trailing steps whose per-rank rates ERS's planner reads (the rules planner: none)."""
    return config.predictive_window if config.planner == "predictive" else 0


def ers_input(*, step: int, is_eval_step: bool, signals: ReadinessSignals,
              records: Sequence[StepRecord], roles: Sequence[Role], placement: Placement,
              measured: dict[Placement, MeasuredPasses], batch: BatchBounds, phase_tasks: int = 0,
              tasks_per_rank: float = 0.0, is_phase_over: bool = False,
              rate_steps: int = 0, idle_steps: int = 1) -> ERSInput:
    """What ERS plans step ``step`` from (at launch, at the end of the cold start, or at the
    boundary after step - 1): the pass times of the decoupled layout these roles have or would
    have (one Ref rank at least); the per-rank rates of the last ``rate_steps`` steps on one
    layout (``ers_predict.rate_window``; 0: none, the rules planner reads no rates); the idle
    shares over the last ``idle_steps`` steps on these roles (``ers.idle_window``)."""
    num_refs, num_actors = roles.count(Role.REF), roles.count(Role.ACTOR)
    timings = layout_timings(measured, Placement.DECOUPLED, num_refs, num_actors)
    colocated = layout_timings(measured, Placement.COLOCATED, num_refs, num_actors)
    return ERSInput(step=step, is_eval_step=is_eval_step, signals=signals,
                    step_duration_s=mean_step_s(records), roles=tuple(roles),
                    placement=placement,
                    timings=timings or NO_TIMINGS,
                    num_micro_batches=max(1, last_num_micro_batches(records)), batch=batch,
                    rollout_idle_frac=rollout_idle_frac(records, idle_steps),
                    trainer_idle_frac=trainer_idle_frac(records, idle_steps),
                    goodput=step_goodput(records),
                    phase_tasks=phase_tasks,
                    tasks_per_rank=tasks_per_rank, is_phase_over=is_phase_over,
                    colocated_timings=colocated, rates=rate_window(records, rate_steps),
                    move_cost_s=move_costs(records))


def step_placement(config: RA2PConfig, signals: ReadinessSignals,
                     measured: dict[Placement, MeasuredPasses], num_refs: int, num_actors: int,
                     records: Sequence[StepRecord]) -> Placement:
    """RA2P's choice for a step opening now: the core cost models on the expected ready times
    (RAS now, the rest TPRM apart; T_step / micro-batches while TPRM is unknown), each layout
    with its own pass times."""
    if config.placement != "auto":
        return Placement(config.placement)
    dec = layout_timings(measured, Placement.DECOUPLED, num_refs, num_actors)
    col = layout_timings(measured, Placement.COLOCATED, num_refs, num_actors)
    if dec is None or col is None:
        return Placement.COLOCATED
    num = max(1, signals.ras, last_num_micro_batches(records))
    tprm = signals.tprm_s if signals.tprm_s is not None else mean_step_s(records) / num
    times = synthetic_ready_times(num, min(signals.ras, num), tprm)
    return choose_placement(times, dec, config.max_aggregate, config, colocated_timings=col)
