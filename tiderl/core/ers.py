"""ERS: the elastic resource scaling policy the step controller plans with (paper §5.2).

Called once per step at the post-update boundary, before ``sync_params``:

    ERSInput (signals, roles, placement) --classify--> reason --hysteresis gate--> role moves
                                          \\--> RA2P placement, batch size in [B_min, B_ideal]

    reason               when                                          moves             placement
    COLD_START           step < cold_start_steps (nothing to train     trainer->rollout  colocated
                         yet): every trainer rank above the minimum
    EVALUATION           an evaluation phase runs: as many actor       trainer->rollout  colocated
                         ranks as its tasks fill (phase_tasks /
                         tasks_per_rank, at least one), at most
                         max_eval_lend of the trainer's ranks
    PHASE_END            the phase's work is done (``is_phase_over``:  the layout before it
                         batch 0 is ready; at the first boundary       is restored        its own
                         after the evaluation groups drained)
    GENERATION_DEFICIT   the trainer starved (TWT share >              trainer->rollout  colocated
                         max_idle_trainer), rollout busy (RWT share <=
                         max_idle_rollout), RAS < break-even, long TPRM
    CONSUMPTION_DEFICIT  a backlog (the trainer did not wait, and HoL  rollout->trainer  decoupled
                         > tau·T_step, TPRM < the actor time, or       (a Ref rank only  with a Ref
                         rollout idle), or RAS >= break-even with      where the cost    rank, else
                         the trainer not starved (which only           model says so)    colocated
                         provisions a missing Ref rank)
    BALANCED             otherwise                                     none              unchanged
    TRIAL                a signal-driven move runs its trial steps     none (held)       unchanged
    REVERT               the trial's goodput is not above the steps    the move undone   before it
                         before the move (the direction is then
                         damped: blocked for damp_steps, doubling)
    PREDICTED            planner "predictive", in place of the two     toward the split  as for the
                         deficits: a split within predictive_max_moves it predicts       deficits
                         predicted to train faster by the margin       (ers_predict)
    MANUAL               an operator's ``tiderl rebalance`` (``ers_manual.manual_plan``: counts
                         in, ranks picked there; the step controller holds it and skips
                         ``plan_step`` until a release)

Role layout: colocated, every trainer rank is ACTOR (it hosts Ref and Actor and swaps); REF ranks
exist only decoupled. IDLE ranks are never moved. Ranks with the highest id move first.
Invariant: a plan never moves a rank out of a group (rollout, trainer) that is at its minimum,
never leaves the trainer without an actor, makes a signal-driven move only when its deficit was
seen at ``confirm_steps`` of the last ``confirm_window`` boundaries and the opposite one at none
(one boundary's reading, such as the backlog the cold start's lent ranks leave behind, moves
nothing; a deficit that comes back every other boundary does), and never reverses the direction
of the last move before ``hysteresis_steps`` boundaries of the opposite deficit among the last
``confirm_window`` (cold start and evaluation moves reset this memory). Phase moves are
temporary: the layout and placement from before a cold start or evaluation phase come back in
one plan when its work is done (``max_scale_up_per_step`` bounds signal-driven moves, not this
restoration). A signal-driven move waits for a step after step 0
to measure against, and goes on trial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tiderl.core.config import require, require_non_negative, require_positive
from tiderl.core.ers_predict import RateWindow, planned_rollout_ranks
from tiderl.core.ers_state import Block, Direction, ERSState, Trial
from tiderl.core.job import BatchBounds
from tiderl.core.quote import short
from tiderl.core.ra2p import RA2PConfig, break_even_ras
from tiderl.core.types import (
    Placement,
    PlanReason,
    Ra2pTimings,
    ReadinessSignals,
    Role,
    RoleChange,
    ScalingPlan,
)

TRAINER_ROLES = (Role.REF, Role.ACTOR)
PLANNERS = ("rules", "predictive")


@dataclass(frozen=True, slots=True)
class ERSConfig:
    """``tau`` scales the mean step time into the HoL threshold. The batch bounds are the job's
    (:class:`tiderl.core.job.JobShape`), in each :class:`ERSInput`."""

    enabled: bool = True
    tau: float = 1.0
    max_scale_up_per_step: int = 1
    confirm_steps: int = 2  # boundaries of one deficit, of the last confirm_window, to move
    hysteresis_steps: int = 2  # ... to move against the last move's direction
    confirm_window: int = 3  # the boundaries those counts look back over
    min_rollout_ranks: int = 1
    min_trainer_ranks: int = 1
    cold_start_steps: int = 1
    # The deficits move ranks (false: only the phases and an operator do; where the ranks share
    # their cores a moved rank adds no capacity, ``step_control.config.effective_config``).
    signal_moves: bool = True
    max_eval_lend: float = 0.5  # an evaluation phase lends at most this share of trainer ranks
    max_idle_rollout: float = 0.2  # a generation deficit needs rollout busy: at most this idle
    max_idle_trainer: float = 0.1  # ... and the trainer starved: above this share waiting (TWT)
    idle_window: int = 3  # trailing steps on the current roles whose idle shares a reading uses
    trial_steps: int = 2  # steps a signal-driven move runs before its effect is measured
    damp_steps: int = 4  # a reverted direction is blocked this long, doubling per failure
    planner: str = "rules"  # "predictive": the split the measured rates say trains fastest
    predictive_max_moves: int = 4  # most ranks one predicted plan moves
    predictive_margin: float = 0.05  # a predicted split must beat the current one by this share
    predictive_window: int = 4  # most trailing steps on one layout its rates are measured over

    def __post_init__(self) -> None:
        require_positive(self.tau, "tau")
        for name in ("max_scale_up_per_step", "confirm_steps", "hysteresis_steps",
                     "idle_window"):
            require(getattr(self, name) >= 1, name, f"expected >= 1, got {getattr(self, name)!r}")
        wanted = max(self.confirm_steps, self.hysteresis_steps)
        require(self.confirm_window >= wanted, "confirm_window",
                f"expected >= confirm_steps and hysteresis_steps ({wanted}), got "
                f"{self.confirm_window!r}")
        for name in ("min_rollout_ranks", "min_trainer_ranks"):
            require(getattr(self, name) >= 1, name, f"expected >= 1, got {getattr(self, name)!r}")
        require_non_negative(self.cold_start_steps, "cold_start_steps")
        for name in ("max_idle_rollout", "max_idle_trainer", "max_eval_lend"):
            value = getattr(self, name)
            require(0.0 <= value <= 1.0, name, f"expected a number in [0, 1], got {short(value)}")
        require_non_negative(self.trial_steps, "trial_steps")
        require_non_negative(self.damp_steps, "damp_steps")
        require(self.planner in PLANNERS, "planner",
                f"expected one of {', '.join(PLANNERS)}, got {short(self.planner)}")
        for name in ("predictive_max_moves", "predictive_window"):
            require(getattr(self, name) >= 1, name, f"expected >= 1, got {getattr(self, name)!r}")
        require_non_negative(self.predictive_margin, "predictive_margin")


@dataclass(frozen=True, slots=True)
class ERSInput:
    """What the step controller knows when it plans step ``step``: at launch (step 0), or at the
    boundary after step ``step - 1``'s update (``step_control.inputs.ers_input`` builds it).

    ``signals`` is the buffer's view for that step (``ReadinessTracker.signals(now)``);
    ``step_duration_s`` is the mean step duration T_step; ``roles[r]`` is rank r's role.
    """

    step: int
    is_eval_step: bool
    signals: ReadinessSignals
    step_duration_s: float
    roles: tuple[Role, ...]
    placement: Placement
    timings: Ra2pTimings  # per micro-batch, in the decoupled layout these roles have or would have
    num_micro_batches: int
    batch: BatchBounds  # the job's elastic batch, in samples
    # over the last ``idle_window`` steps on these roles (``step_control.inputs``):
    rollout_idle_frac: float = 0.0  # share of rollout GPU time idle (RWT / capacity)
    trainer_idle_frac: float = 0.0  # share of trainer GPU time waiting for data (TWT / capacity)
    goodput: tuple[float, ...] = ()  # trained tokens per second of steps 0 .. step - 1
    phase_tasks: int = 0  # evaluation tasks not yet finished (the phase's extra rollout work)
    tasks_per_rank: float = 0.0  # tasks one rollout rank holds at once (0: not known yet)
    is_phase_over: bool = False  # the cold start's work is done (batch 0 ready): restore now
    colocated_timings: Ra2pTimings | None = None  # the colocated layout's (None: ``timings``)
    rates: RateWindow | None = None  # the per-rank rates of the steps on these roles (predictive)
    move_cost_s: tuple[tuple[Direction, float], ...] = ()  # the time a move that way added to
    # its boundary, measured (``step_control.inputs.move_costs``; a direction never moved: absent)

    def __post_init__(self) -> None:
        if self.step_duration_s < 0 or self.num_micro_batches < 0:
            raise ValueError(
                f"need step_duration_s >= 0 and num_micro_batches >= 0, "
                f"got {self.step_duration_s}, {self.num_micro_batches}"
            )


# --------------------------------------------------------------------------- signals


def decoupled_break_even(inp: ERSInput, ra2p: RA2PConfig) -> int | None:
    """``ra2p.break_even_ras`` for this step; an unknown TPRM counts as one gap per step."""
    tprm = inp.signals.tprm_s if inp.signals.tprm_s is not None else inp.step_duration_s
    return break_even_ras(
        inp.num_micro_batches,
        tprm,
        inp.timings,
        ra2p.max_aggregate,
        ra2p.decoupled_margin,
        inp.colocated_timings,
    )


def is_ras_at_break_even(inp: ERSInput, ra2p: RA2PConfig) -> bool:
    """RAS is at RA2P's break-even: the decoupled layout would run this step cheaper."""
    break_even = decoupled_break_even(inp, ra2p)
    return break_even is not None and inp.signals.ras >= break_even


def classify(inp: ERSInput, config: ERSConfig, ra2p: RA2PConfig) -> PlanReason:
    """The reason for this step's plan; phases first, then generation before consumption.

    A generation deficit needs a starved trainer (its ranks waited for data: TWT share above
    ``max_idle_trainer``) and busy rollout ranks (RWT share at most ``max_idle_rollout``); a
    buffer that is empty at the boundary alone is not one (a streaming trainer empties it), nor
    is rollout that is slow because its tasks wait for their environments: its ranks then idle
    (RWT), and more of them would not produce more. See ``is_backlogged`` for consumption; RAS
    at RA2P's break-even is trainer-side pressure (a Ref rank of its own would pay) only while the
    trainer did not starve: where its ranks waited for data, cheaper passes train nothing sooner,
    and the rollout rank a Ref rank takes is generation lost."""
    if inp.step < config.cold_start_steps and not inp.is_phase_over:
        return PlanReason.COLD_START
    if inp.is_eval_step:
        return PlanReason.EVALUATION
    sig = inp.signals
    busy = inp.timings.t_act_f + inp.timings.t_act_b
    is_ras_high = is_ras_at_break_even(inp, ra2p)
    is_tprm_long = sig.tprm_s is None or sig.tprm_s > busy
    is_rollout_busy = inp.rollout_idle_frac <= config.max_idle_rollout
    is_trainer_starved = inp.trainer_idle_frac > config.max_idle_trainer
    if sig.ready_volume < inp.batch.ideal and not is_ras_high and is_tprm_long \
            and is_rollout_busy and is_trainer_starved:
        return PlanReason.GENERATION_DEFICIT
    if is_backlogged(inp, config) or (is_ras_high and not is_trainer_starved):
        return PlanReason.CONSUMPTION_DEFICIT
    return PlanReason.BALANCED


def is_backlogged(inp: ERSInput, config: ERSConfig) -> bool:
    """The trainer cannot keep up: the buffer's head is older than tau·T_step, micro-batches
    arrive faster than the actor processes one (paper §5.2: "a large RAS or fast TPRM indicates
    trainer-side pressure and triggers decoupled RA2P plus more Trainer capacity"), or rollout
    ranks sat idle on a full staleness window (RWT share above ``max_idle_rollout``) while the
    trainer did not wait."""
    if inp.trainer_idle_frac > config.max_idle_trainer:
        return False  # its ranks waited for data: whatever the buffer shows, it keeps up
    busy = inp.timings.t_act_f + inp.timings.t_act_b
    tprm = inp.signals.tprm_s
    is_throttled = inp.step > 0 and inp.rollout_idle_frac > config.max_idle_rollout
    return inp.signals.hol_latency_s > config.tau * inp.step_duration_s or (
        tprm is not None and tprm < busy) or is_throttled


def elastic_batch_size(ready_volume: int, batch: BatchBounds, is_retaining: bool) -> int:
    """B_ideal, except under adaptive retention: right after ERS scaled rollout down with less
    than B_ideal ready, the trainer fetches only max(B_min, ready) for one step, keeping a
    reservoir while the smaller rollout refills (paper §5.2).

    The ready volume at the boundary alone does not shrink the batch: a streaming trainer
    consumes micro-batches as they arrive, so the buffer is often near-empty at the boundary of a
    healthy pipeline; shrinking the batch there would only add per-step sync and swap costs."""
    if ready_volume >= batch.ideal or not is_retaining:
        return batch.ideal
    return max(batch.min, min(ready_volume, batch.ideal))


# --------------------------------------------------------------------------- role moves


def ranks_with(roles: tuple[Role, ...], role: Role) -> list[int]:
    """Ranks holding ``role``, highest id first (the order in which they move)."""
    return [r for r in range(len(roles) - 1, -1, -1) if roles[r] is role]


@dataclass(slots=True)
class _Layout:
    """Role counts while a plan is being built."""

    roles: list[Role]
    changes: list[RoleChange] = field(default_factory=list)

    def count(self, *wanted: Role) -> int:
        return sum(1 for role in self.roles if role in wanted)

    def move(self, rank: int, dst: Role) -> None:
        self.changes.append(RoleChange(rank, self.roles[rank], dst))
        self.roles[rank] = dst


def _release_refs(layout: _Layout, refs: list[int], keep_refs: int, min_trainer: int) -> int:
    """Refs beyond ``keep_refs`` go to rollout (or become actors at the trainer minimum)."""
    surplus = refs[: max(0, len(refs) - keep_refs)]
    for rank in surplus:
        at_min = layout.count(*TRAINER_ROLES) <= min_trainer
        layout.move(rank, Role.ACTOR if at_min else Role.ROLLOUT)
    return len(surplus)


def _release_actors(layout: _Layout, actors: list[int], limit: int, min_trainer: int) -> None:
    for rank in actors[:limit]:
        if layout.count(*TRAINER_ROLES) <= min_trainer or layout.count(Role.ACTOR) <= 1:
            return
        layout.move(rank, Role.ROLLOUT)


def moves_to_rollout(
    roles: tuple[Role, ...], config: ERSConfig, keep_refs: int, *, num_phase: int | None = None
) -> tuple[RoleChange, ...]:
    """Scale rollout up: the surplus Ref ranks, then actor ranks above the minimum: for a phase,
    ``num_phase`` of them; for a generation deficit (``num_phase`` None), at most
    ``max_scale_up_per_step``, and none when a surplus Ref rank was released."""
    layout = _Layout(list(roles))
    refs, actors = ranks_with(roles, Role.REF), ranks_with(roles, Role.ACTOR)
    num_released = _release_refs(layout, refs, keep_refs, config.min_trainer_ranks)
    if num_phase is not None or num_released == 0:
        limit = config.max_scale_up_per_step if num_phase is None else num_phase
        _release_actors(layout, actors, limit, config.min_trainer_ranks)
    return tuple(layout.changes)


def num_eval_ranks(inp: ERSInput, saved: tuple[Role, ...] | None, max_lend: float = 1.0
                   ) -> int:
    """Actor ranks an evaluation phase lends to rollout now: the ranks its unfinished tasks fill
    (at least one), at most ``max_lend`` of the trainer's ranks before the phase (the step's
    batch trains beside the evaluation: on sim/fig8-paper, lending by KV alone left 2 of 32
    GPUs to train it, and the step took 123 s against 57 s), less those already lent."""
    before = saved or inp.roles
    wanted = math.ceil(inp.phase_tasks / inp.tasks_per_rank) if inp.tasks_per_rank > 0 else 1
    cap = math.floor(max_lend * sum(1 for role in before if role in TRAINER_ROLES))
    lent = 0 if saved is None else sum(
        1 for now, was in zip(inp.roles, saved, strict=False)
        if now is Role.ROLLOUT and was in TRAINER_ROLES)
    return max(0, max(1, min(wanted, cap)) - lent)


def moves_to_trainer(
    roles: tuple[Role, ...], config: ERSConfig, num_refs_needed: int, *, is_backlogged: bool,
    num: int | None = None,
) -> tuple[RoleChange, ...]:
    """Scale the trainer up by at most ``max_scale_up_per_step`` rollout ranks (above the
    minimum), or by ``num`` of them for the predictive planner; each becomes a Ref rank while
    fewer than ``num_refs_needed`` exist, else an actor.
    Without a backlog (see ``is_backlogged``; only RAS is at the break-even) only missing Ref
    ranks are provisioned: the decoupled placement is what that signal asks for (paper §5.2: it
    "reclaims a Rollout rank to provision a dedicated Ref rank"). With no rollout rank
    to spare, an actor becomes the missing Ref if another actor remains."""
    layout = _Layout(list(roles))
    spare = layout.count(Role.ROLLOUT) - config.min_rollout_ranks
    num_missing_refs = max(0, num_refs_needed - layout.count(Role.REF))
    wanted = config.max_scale_up_per_step if is_backlogged else num_missing_refs
    num_moves = max(0, min(spare, wanted, config.max_scale_up_per_step) if num is None
                    else min(spare, num))
    for rank in ranks_with(roles, Role.ROLLOUT)[:num_moves]:
        is_ref_missing = layout.count(Role.REF) < num_refs_needed
        layout.move(rank, Role.REF if is_ref_missing and layout.count(Role.ACTOR) else Role.ACTOR)
    if not layout.changes and num_refs_needed and not layout.count(Role.REF):
        actors = ranks_with(roles, Role.ACTOR)
        if len(actors) >= 2:
            layout.move(actors[0], Role.REF)
    return tuple(layout.changes)


def _restore(roles: tuple[Role, ...], saved: tuple[Role, ...]) -> tuple[RoleChange, ...]:
    """Moves back to ``saved`` for every rank a phase changed (idle ranks stay as they are)."""
    return tuple(
        RoleChange(rank, now, before)
        for rank, (now, before) in enumerate(zip(roles, saved, strict=False))
        if now != before and Role.IDLE not in (now, before)
    )


def _apply(roles: tuple[Role, ...], changes: tuple[RoleChange, ...]) -> tuple[Role, ...]:
    new_roles = list(roles)
    for change in changes:
        new_roles[change.rank] = change.dst
    return tuple(new_roles)


# --------------------------------------------------------------------------- the policy


def _fixed_placement(ra2p: RA2PConfig) -> Placement | None:
    return None if ra2p.placement == "auto" else Placement(ra2p.placement)


def _scale_rollout(
    inp: ERSInput, config: ERSConfig, ra2p: RA2PConfig, num_phase: int | None = None
) -> tuple[tuple[RoleChange, ...], Placement]:
    placement = _fixed_placement(ra2p) or Placement.COLOCATED
    return moves_to_rollout(inp.roles, config, _kept_refs(ra2p), num_phase=num_phase), placement


def _kept_refs(ra2p: RA2PConfig) -> int:
    """Ref ranks a scale-up of rollout keeps: only a fixed decoupled placement needs them."""
    return ra2p.num_ref_ranks if _fixed_placement(ra2p) is Placement.DECOUPLED else 0


def _scale_trainer(
    inp: ERSInput, config: ERSConfig, ra2p: RA2PConfig, num: int | None = None
) -> tuple[tuple[RoleChange, ...], Placement]:
    fixed = _fixed_placement(ra2p)
    wants_ref = fixed is Placement.DECOUPLED or (fixed is None and is_ras_at_break_even(inp, ra2p))
    num_refs = ra2p.num_ref_ranks if wants_ref else 0
    changes = moves_to_trainer(inp.roles, config, num_refs,
                               is_backlogged=is_backlogged(inp, config), num=num)
    new_roles = _apply(inp.roles, changes)
    if not wants_ref:  # RA2P's cost model prefers colocated: a Ref rank serves as an actor
        changes += tuple(RoleChange(r, Role.REF, Role.ACTOR) for r in ranks_with(new_roles,
                                                                                 Role.REF))
        new_roles = _apply(inp.roles, changes)
    has_pipeline = Role.REF in new_roles and Role.ACTOR in new_roles
    return changes, fixed or (Placement.DECOUPLED if has_pipeline else Placement.COLOCATED)


def _seen(state: ERSState, reading: Direction | None, config: ERSConfig) -> ERSState:
    """``state`` with this boundary's reading added to the recent ones."""
    return replace(state, recent=(*state.recent, reading)[-config.confirm_window:])


def _gate(state: ERSState, direction: Direction, config: ERSConfig) -> tuple[bool, ERSState]:
    """(may act now, the state with this boundary's deficit seen): a move needs its deficit at
    ``confirm_steps`` of the last ``confirm_window`` boundaries (``hysteresis_steps`` where it
    reverses the last move) and the opposite deficit at none of them."""
    state = _seen(state, direction, config)
    is_reversal = state.last_direction not in (None, direction)
    needed = config.hysteresis_steps if is_reversal else config.confirm_steps
    is_contested = any(seen not in (None, direction) for seen in state.recent)
    return state.recent.count(direction) >= needed and not is_contested, state


def _mean(values: tuple[float, ...]) -> float | None:
    return sum(values) / len(values) if values else None


def _undo(roles: tuple[Role, ...], changes: tuple[RoleChange, ...], config: ERSConfig
          ) -> tuple[RoleChange, ...]:
    """The moves back for every rank of ``changes`` still where they sent it, each only while
    the layout keeps its minimums (rollout, trainer, one actor): ranks may have died since."""
    layout = _Layout(list(roles))
    for c in changes:
        if roles[c.rank] is not c.dst:
            continue
        layout.move(c.rank, c.src)
        if layout.count(Role.ROLLOUT) < config.min_rollout_ranks \
                or layout.count(*TRAINER_ROLES) < config.min_trainer_ranks \
                or not layout.count(Role.ACTOR):
            layout.changes.pop()
            layout.roles[c.rank] = c.dst
    return tuple(layout.changes)


def _judge(inp: ERSInput, state: ERSState, config: ERSConfig
           ) -> tuple[ScalingPlan | None, ERSState]:
    """The move on trial, once its trial steps ran: kept (trial over, its direction's damping
    forgotten), or undone (REVERT) with its direction blocked for a doubled stretch."""
    trial = state.trial
    if trial is None:
        return None, state
    if inp.step < trial.step + config.trial_steps:
        return ScalingPlan((), inp.placement, inp.batch.ideal, PlanReason.TRIAL), state
    after = _mean(inp.goodput[trial.step: trial.step + config.trial_steps])
    if after is not None and after > trial.baseline:
        return None, replace(state, trial=None, blocks=state.unblocked(trial.direction))
    last = state.block(trial.direction)
    steps = min(64, last.steps * 2) if last is not None else config.damp_steps
    block = Block(trial.direction, inp.step + steps, steps)
    state = ERSState(blocks=(*state.unblocked(trial.direction), block))
    changes = _undo(inp.roles, trial.changes, config)
    new_roles = _apply(inp.roles, changes)
    has_pipeline = Role.REF in new_roles and Role.ACTOR in new_roles
    placement = trial.placement if has_pipeline or trial.placement is Placement.COLOCATED \
        else Placement.COLOCATED
    return ScalingPlan(changes, placement, inp.batch.ideal, PlanReason.REVERT), state


def _signal_moves(inp: ERSInput, state: ERSState, config: ERSConfig, ra2p: RA2PConfig,
                  direction: Direction, num: int | None = None
                  ) -> tuple[tuple[RoleChange, ...], Placement, ERSState]:
    """A deficit's moves (``num`` ranks for the predictive planner, else the rules' count),
    through the hysteresis gate and the damping block; a move goes on trial against the steps
    before it (step 0 excluded: its span holds the launch's rollout), and none is made before
    there is such a step."""
    block = state.block(direction)
    if not config.signal_moves or (block is not None and inp.step < block.until):
        return (), inp.placement, state
    history = inp.goodput[1:]  # step 0's span holds the launch's rollout: no baseline
    if config.trial_steps and inp.goodput and not history:
        return (), inp.placement, state  # nothing steady yet to measure a move against
    may_act, state = _gate(state, direction, config)
    if not may_act or not can_pay_back(inp, config, direction):
        return (), inp.placement, state
    if direction is Direction.TO_ROLLOUT:
        changes, placement = _scale_rollout(inp, config, ra2p, _num_actors_out(inp, ra2p, num))
    else:
        changes, placement = _scale_trainer(inp, config, ra2p, num)
    if changes:
        state = replace(state, recent=(), last_direction=direction)
    baseline = _mean(history[-2 * config.trial_steps:])
    if changes and config.trial_steps and baseline:
        state = replace(state, trial=Trial(direction, changes, inp.placement, inp.step, baseline))
    return changes, placement, state


def can_pay_back(inp: ERSInput, config: ERSConfig, direction: Direction) -> bool:
    """Whether a move ``direction`` could pass its trial: the trial keeps it only if its
    ``trial_steps`` steps, the move's boundary included, train faster than the steps before, so
    the move must win back its measured cost within them. A step can win at most the time the
    side that gains the rank left on the table: the trainer's wait for a move to rollout
    (``trainer_idle_frac`` of T_step), the trainer's busy time for a move to the trainer. A
    direction with no measured move, or no trial, may always move (the first move measures)."""
    cost = dict(inp.move_cost_s).get(direction)
    if cost is None or not config.trial_steps:
        return True
    idle = inp.trainer_idle_frac
    gain = idle if direction is Direction.TO_ROLLOUT else 1.0 - idle
    return config.trial_steps * gain * inp.step_duration_s > cost


def _num_actors_out(inp: ERSInput, ra2p: RA2PConfig, num: int | None) -> int | None:
    """Of ``num`` trainer ranks to move to rollout, the actors: the rest are surplus Ref
    ranks, which ``moves_to_rollout`` releases first (None: the rules' count)."""
    if num is None:
        return None
    return max(0, num - max(0, inp.roles.count(Role.REF) - _kept_refs(ra2p)))


def _predicted_moves(inp: ERSInput, state: ERSState, config: ERSConfig, ra2p: RA2PConfig
                     ) -> tuple[tuple[RoleChange, ...], Placement, ERSState, PlanReason]:
    """The predictive planner (``ers_predict``): move toward the split with the highest
    predicted goodput, through the same gate, damping and trial as a rule's move; BALANCED
    while no steps on this layout were measured or no split beats it by the margin. The placement
    and the Ref ranks follow RA2P's break-even as for the rules."""
    num_rollout = inp.roles.count(Role.ROLLOUT)
    num_movable = num_rollout + sum(inp.roles.count(role) for role in TRAINER_ROLES)
    target = num_rollout if inp.rates is None else planned_rollout_ranks(
        num_rollout, num_movable, inp.rates, lo=config.min_rollout_ranks,
        hi=num_movable - config.min_trainer_ranks, max_moves=config.predictive_max_moves,
        margin=config.predictive_margin)
    if target == num_rollout:
        return (), inp.placement, _seen(state, None, config), PlanReason.BALANCED
    direction = Direction.TO_ROLLOUT if target > num_rollout else Direction.TO_TRAINER
    changes, placement, state = _signal_moves(inp, state, config, ra2p, direction,
                                         abs(target - num_rollout))
    return changes, placement, state, PlanReason.PREDICTED if changes else PlanReason.BALANCED


def plan_step(
    inp: ERSInput, state: ERSState, config: ERSConfig, ra2p: RA2PConfig
) -> tuple[ScalingPlan, ERSState]:
    """One ERS decision and the next state; pure."""
    if not config.enabled:
        return ScalingPlan((), inp.placement, inp.batch.ideal, PlanReason.BALANCED), state
    reason = classify(inp, config, ra2p)
    changes: tuple[RoleChange, ...] = ()
    placement = inp.placement
    damping = {"blocks": state.blocks}
    if inp.is_phase_over and state.saved_roles is not None:
        changes = _restore(inp.roles, state.saved_roles)
        placement = state.saved_placement or inp.placement
        reason, state = PlanReason.PHASE_END, ERSState(**damping)
    elif reason in (PlanReason.COLD_START, PlanReason.EVALUATION):
        num = num_eval_ranks(inp, state.saved_roles, config.max_eval_lend) \
            if reason is PlanReason.EVALUATION \
            else len(inp.roles)  # the cold start: nothing to train yet, every rank above the min
        changes, placement = _scale_rollout(inp, config, ra2p, num)
        saved_roles = state.saved_roles or inp.roles  # a phase right after a phase keeps the first
        saved_placement = state.saved_placement or inp.placement
        state = ERSState(saved_roles=saved_roles, saved_placement=saved_placement, **damping)
    elif state.saved_roles is not None:
        changes = _restore(inp.roles, state.saved_roles)
        placement = state.saved_placement or inp.placement
        reason, state = PlanReason.PHASE_END, ERSState(**damping)  # fresh hysteresis
    else:
        verdict, state = _judge(inp, state, config)
        if verdict is not None:
            return verdict, state
        if config.planner == "predictive":
            changes, placement, state, reason = _predicted_moves(inp, state, config, ra2p)
        elif reason is PlanReason.BALANCED:
            state = _seen(state, None, config)
        else:
            direction = Direction.TO_ROLLOUT if reason is PlanReason.GENERATION_DEFICIT \
                else Direction.TO_TRAINER
            changes, placement, state = _signal_moves(inp, state, config, ra2p, direction)
    is_retaining = any(c.src is Role.ROLLOUT for c in changes)
    batch_size = elastic_batch_size(inp.signals.ready_volume, inp.batch, is_retaining)
    return ScalingPlan(changes, placement, batch_size, reason), state


class ERSPolicy:
    """``plan_step`` with its hysteresis state kept between plans (no clock, no I/O).
    :meth:`propose` is pure: a caller that cannot run the plan (the layout limits refuse it)
    keeps the state it had, since the moves never happened; :meth:`plan` keeps the new one."""

    def __init__(self, config: ERSConfig | None = None, ra2p: RA2PConfig | None = None) -> None:
        self.config = config or ERSConfig()
        self.ra2p = ra2p or RA2PConfig()
        self.state = ERSState()

    def propose(self, inp: ERSInput) -> tuple[ScalingPlan, ERSState]:
        """The plan for ``inp`` and the state it leaves, without keeping it."""
        return plan_step(inp, self.state, self.config, self.ra2p)

    def plan(self, inp: ERSInput) -> ScalingPlan:
        plan, self.state = self.propose(inp)
        return plan

    def reset(self) -> None:
        """Forget the hysteresis and any saved phase layout: a manual plan replaced the layout
        they were about, so ERS starts afresh from it when it plans again."""
        self.state = ERSState()
