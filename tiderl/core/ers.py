"""ERS: the elastic resource scaling policy the step controller plans with (paper §5.2).

Called once per step at the post-update boundary, before ``sync_params``:

    ERSInput (signals, roles, mode) --classify--> reason --hysteresis gate--> role moves + mode
                                                        \\--> elastic batch size in [B_min, B_ideal]

    reason               when                                          moves             mode
    COLD_START           step < cold_start_steps                       trainer->rollout  colocated
    EVALUATION           an evaluation phase runs                      trainer->rollout  colocated
    PHASE_END            the first step after such a phase             the layout before it
                                                                       is restored        its mode
    GENERATION_DEFICIT   volume < B_ideal, RAS < break-even, long TPRM trainer->rollout  colocated
                         and rollout busy (idle share <= max_idle_rollout)
    CONSUMPTION_DEFICIT  HoL > tau·T_step, or RAS >= break-even        rollout->trainer  decoupled
                         (a backlog -- HoL over the threshold or TPRM shorter than the actor time --
                         moves ranks; RAS alone only provisions a missing Ref rank)
    BALANCED             otherwise                                     none              unchanged
    MANUAL               an operator's ``tiderl rebalance`` (``manual_plan``: counts in, ranks
                         picked here; the step controller holds it and skips ``plan_step`` until
                         a release)

Role layout: in colocated mode every trainer rank is ACTOR (it hosts Ref and Actor and swaps);
REF ranks exist only in decoupled mode. IDLE ranks are never moved. Ranks with the highest id move
first. Invariant: a plan never moves a rank out of a group (rollout, trainer) that is at its
minimum, never leaves the trainer without an actor, and never reverses the direction of the last
move before ``hysteresis_steps`` consecutive steps of the opposite deficit (a balanced step breaks
the streak; cold start and evaluation moves reset this memory). Phase moves are temporary: the
layout and mode from before a cold start or evaluation phase come back, in one plan, at the first
step after it (``max_scale_up_per_step`` bounds signal-driven moves, not this restoration).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tiderl.core.config import require, require_non_negative, require_positive
from tiderl.core.ra2p import RA2PConfig, break_even_ras
from tiderl.core.types import (
    Mode,
    PlanReason,
    Ra2pTimings,
    ReadinessSignals,
    Role,
    RoleChange,
    ScalingPlan,
)

TRAINER_ROLES = (Role.REF, Role.ACTOR)


@dataclass(frozen=True, slots=True)
class ERSConfig:
    """Batch sizes are in samples; ``tau`` scales the mean step time into the HoL threshold."""

    enabled: bool = True
    batch_min: int = 32
    batch_ideal: int = 64
    tau: float = 1.0
    max_scale_up_per_step: int = 1
    hysteresis_steps: int = 2
    min_rollout_ranks: int = 1
    min_trainer_ranks: int = 1
    cold_start_steps: int = 1
    max_idle_rollout: float = 0.2  # a generation deficit needs rollout busy: at most this idle

    def __post_init__(self) -> None:
        require_positive(self.batch_min, "batch_min")
        require(
            self.batch_min <= self.batch_ideal,
            "batch_min",
            f"expected <= batch_ideal ({self.batch_ideal}), got {self.batch_min}",
        )
        require_positive(self.tau, "tau")
        for name in ("max_scale_up_per_step", "hysteresis_steps"):
            require(getattr(self, name) >= 1, name, f"expected >= 1, got {getattr(self, name)!r}")
        for name in ("min_rollout_ranks", "min_trainer_ranks"):
            require(getattr(self, name) >= 1, name, f"expected >= 1, got {getattr(self, name)!r}")
        require_non_negative(self.cold_start_steps, "cold_start_steps")
        require(0.0 <= self.max_idle_rollout <= 1.0, "max_idle_rollout",
                f"expected a number in [0, 1], got {self.max_idle_rollout!r}")


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
    mode: Mode
    timings: Ra2pTimings
    num_micro_batches: int
    rollout_idle_frac: float = 0.0  # share of rollout GPU time idle last step (RWT / capacity)

    def __post_init__(self) -> None:
        if self.step_duration_s < 0 or self.num_micro_batches < 0:
            raise ValueError(
                f"need step_duration_s >= 0 and num_micro_batches >= 0, "
                f"got {self.step_duration_s}, {self.num_micro_batches}"
            )


class Direction(str, Enum):
    """Which way a plan moved ranks."""

    TO_ROLLOUT = "to_rollout"
    TO_TRAINER = "to_trainer"


@dataclass(frozen=True, slots=True)
class ERSState:
    """Hysteresis memory: the direction of the last signal-driven move, and how many consecutive
    steps the opposite deficit has been seen since; during a phase (cold start, evaluation), the
    layout and mode from before it."""

    last_direction: Direction | None = None
    opposite_streak: int = 0
    saved_roles: tuple[Role, ...] | None = None
    saved_mode: Mode | None = None


# --------------------------------------------------------------------------- signals


def decoupled_break_even(inp: ERSInput, ra2p: RA2PConfig) -> int | None:
    """``ra2p.break_even_ras`` for this step; an unknown TPRM counts as one gap per step."""
    tprm = inp.signals.tprm_s if inp.signals.tprm_s is not None else inp.step_duration_s
    num_actors = max(1, inp.roles.count(Role.ACTOR))
    return break_even_ras(
        inp.num_micro_batches,
        tprm,
        inp.timings,
        num_actors,
        ra2p.max_aggregate,
        ra2p.decoupled_margin,
    )


def classify(inp: ERSInput, config: ERSConfig, ra2p: RA2PConfig) -> PlanReason:
    """The reason for this step's plan; phases first, then generation before consumption (a
    starved trainer also ages the buffer's head, so HoL alone does not mean slow consumption).
    A generation deficit also needs busy rollout ranks: when they sat idle (the staleness
    throttle held them: RWT), more of them would not produce more."""
    if inp.step < config.cold_start_steps:
        return PlanReason.COLD_START
    if inp.is_eval_step:
        return PlanReason.EVALUATION
    sig = inp.signals
    busy = inp.timings.t_act_f + inp.timings.t_act_b
    break_even = decoupled_break_even(inp, ra2p)
    is_ras_high = break_even is not None and sig.ras >= break_even
    is_tprm_long = sig.tprm_s is None or sig.tprm_s > busy
    is_rollout_busy = inp.rollout_idle_frac <= config.max_idle_rollout
    if sig.ready_volume < config.batch_ideal and not is_ras_high and is_tprm_long \
            and is_rollout_busy:
        return PlanReason.GENERATION_DEFICIT
    if sig.hol_latency_s > config.tau * inp.step_duration_s or is_ras_high:
        return PlanReason.CONSUMPTION_DEFICIT
    return PlanReason.BALANCED


def is_backlogged(inp: ERSInput, config: ERSConfig) -> bool:
    """The trainer cannot keep up: the buffer's head is older than tau·T_step, or micro-batches
    arrive faster than the actor processes one (paper §5.2: "a large RAS or fast TPRM indicates
    trainer-side pressure and triggers decoupled RA2P plus more Trainer capacity")."""
    busy = inp.timings.t_act_f + inp.timings.t_act_b
    tprm = inp.signals.tprm_s
    return inp.signals.hol_latency_s > config.tau * inp.step_duration_s or (
        tprm is not None and tprm < busy)


def elastic_batch_size(ready_volume: int, config: ERSConfig, is_retaining: bool) -> int:
    """B_ideal, except under adaptive retention: right after ERS scaled rollout down with less
    than B_ideal ready, the trainer fetches only max(B_min, ready) for one step, keeping a
    reservoir while the smaller rollout refills (paper §5.2).

    The ready volume at the boundary alone does not shrink the batch: a streaming trainer
    consumes micro-batches as they arrive, so the buffer is often near-empty at the boundary of a
    healthy pipeline; shrinking the batch there would only add per-step sync and swap costs."""
    if ready_volume >= config.batch_ideal or not is_retaining:
        return config.batch_ideal
    return max(config.batch_min, min(ready_volume, config.batch_ideal))


# --------------------------------------------------------------------------- role moves


def _ranks_with(roles: tuple[Role, ...], role: Role) -> list[int]:
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
    roles: tuple[Role, ...], config: ERSConfig, keep_refs: int, *, is_preemptive: bool
) -> tuple[RoleChange, ...]:
    """Scale rollout up. Preemptive (cold start, evaluation): every trainer rank beyond the
    minimum. Generation deficit: the surplus Ref ranks, or if there are none, at most
    ``max_scale_up_per_step`` actor ranks above the minimum."""
    layout = _Layout(list(roles))
    refs, actors = _ranks_with(roles, Role.REF), _ranks_with(roles, Role.ACTOR)
    num_released = _release_refs(layout, refs, keep_refs, config.min_trainer_ranks)
    if is_preemptive or num_released == 0:
        limit = len(actors) if is_preemptive else config.max_scale_up_per_step
        _release_actors(layout, actors, limit, config.min_trainer_ranks)
    return tuple(layout.changes)


def moves_to_trainer(
    roles: tuple[Role, ...], config: ERSConfig, num_refs_needed: int, *, is_backlogged: bool
) -> tuple[RoleChange, ...]:
    """Scale the trainer up by at most ``max_scale_up_per_step`` rollout ranks (above the
    minimum); each becomes a Ref rank while fewer than ``num_refs_needed`` exist, else an actor.
    Without a backlog (see ``is_backlogged``; only RAS is at the break-even) only missing Ref
    ranks are provisioned: the decoupled mode is what that signal asks for (paper §5.2: it
    "reclaims a Rollout rank to provision a dedicated Ref rank"). With no rollout rank
    to spare, an actor becomes the missing Ref if another actor remains."""
    layout = _Layout(list(roles))
    spare = layout.count(Role.ROLLOUT) - config.min_rollout_ranks
    num_missing_refs = max(0, num_refs_needed - layout.count(Role.REF))
    wanted = config.max_scale_up_per_step if is_backlogged else num_missing_refs
    num_moves = max(0, min(spare, wanted, config.max_scale_up_per_step))
    for rank in _ranks_with(roles, Role.ROLLOUT)[:num_moves]:
        is_ref_missing = layout.count(Role.REF) < num_refs_needed
        layout.move(rank, Role.REF if is_ref_missing and layout.count(Role.ACTOR) else Role.ACTOR)
    if not layout.changes and num_refs_needed and not layout.count(Role.REF):
        actors = _ranks_with(roles, Role.ACTOR)
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


def _fixed_mode(ra2p: RA2PConfig) -> Mode | None:
    return None if ra2p.mode == "auto" else Mode(ra2p.mode)


def _scale_rollout(
    inp: ERSInput, config: ERSConfig, ra2p: RA2PConfig, is_preemptive: bool
) -> tuple[tuple[RoleChange, ...], Mode]:
    mode = _fixed_mode(ra2p) or Mode.COLOCATED
    keep_refs = ra2p.num_ref_ranks if mode is Mode.DECOUPLED else 0
    return moves_to_rollout(inp.roles, config, keep_refs, is_preemptive=is_preemptive), mode


def _scale_trainer(
    inp: ERSInput, config: ERSConfig, ra2p: RA2PConfig
) -> tuple[tuple[RoleChange, ...], Mode]:
    fixed = _fixed_mode(ra2p)
    num_refs = 0 if fixed is Mode.COLOCATED else ra2p.num_ref_ranks
    backlog = is_backlogged(inp, config)
    changes = moves_to_trainer(inp.roles, config, num_refs, is_backlogged=backlog)
    new_roles = _apply(inp.roles, changes)
    has_pipeline = Role.REF in new_roles and Role.ACTOR in new_roles
    return changes, fixed or (Mode.DECOUPLED if has_pipeline else Mode.COLOCATED)


def _gate(state: ERSState, direction: Direction, hysteresis_steps: int) -> tuple[bool, int]:
    """(may act now, the new opposite streak)."""
    if state.last_direction in (None, direction):
        return True, 0
    streak = state.opposite_streak + 1
    return streak >= hysteresis_steps, streak


def plan_step(
    inp: ERSInput, state: ERSState, config: ERSConfig, ra2p: RA2PConfig
) -> tuple[ScalingPlan, ERSState]:
    """One ERS decision and the next hysteresis state; pure."""
    if not config.enabled:
        return ScalingPlan((), inp.mode, config.batch_ideal, PlanReason.BALANCED), state
    reason = classify(inp, config, ra2p)
    changes: tuple[RoleChange, ...] = ()
    mode = inp.mode
    if reason in (PlanReason.COLD_START, PlanReason.EVALUATION):
        changes, mode = _scale_rollout(inp, config, ra2p, is_preemptive=True)
        saved_roles = state.saved_roles or inp.roles  # a phase right after a phase keeps the first
        saved_mode = state.saved_mode or inp.mode
        state = ERSState(saved_roles=saved_roles, saved_mode=saved_mode)
    elif state.saved_roles is not None:
        changes, mode = _restore(inp.roles, state.saved_roles), state.saved_mode or inp.mode
        reason, state = PlanReason.PHASE_END, ERSState()  # fresh hysteresis after a phase
    elif reason is PlanReason.BALANCED:
        state = ERSState(state.last_direction, 0)
    else:
        is_generation = reason is PlanReason.GENERATION_DEFICIT
        direction = Direction.TO_ROLLOUT if is_generation else Direction.TO_TRAINER
        may_act, streak = _gate(state, direction, config.hysteresis_steps)
        state = ERSState(state.last_direction, streak)
        if may_act:
            changes, mode = (
                _scale_rollout(inp, config, ra2p, is_preemptive=False)
                if is_generation
                else _scale_trainer(inp, config, ra2p)
            )
            state = ERSState(direction if changes else state.last_direction, 0)
    is_retaining = any(c.src is Role.ROLLOUT for c in changes)
    batch_size = elastic_batch_size(inp.signals.ready_volume, config, is_retaining)
    return ScalingPlan(changes, mode, batch_size, reason), state


class ERSPolicy:
    """``plan_step`` with its hysteresis state kept between calls (no clock, no I/O)."""

    def __init__(self, config: ERSConfig | None = None, ra2p: RA2PConfig | None = None) -> None:
        self.config = config or ERSConfig()
        self.ra2p = ra2p or RA2PConfig()
        self.state = ERSState()

    def plan(self, inp: ERSInput) -> ScalingPlan:
        plan, self.state = plan_step(inp, self.state, self.config, self.ra2p)
        return plan

    def reset(self) -> None:
        """Forget the hysteresis and any saved phase layout: a manual plan replaced the layout
        they were about, so ERS starts afresh from it when it plans again."""
        self.state = ERSState()


# --------------------------------------------------------------------------- manual plans
#
# ``tiderl rebalance --rollout N --trainer M [--mode]``: the operator gives the counts, these pick
# the ranks. Ranks stay in place where they can; leaving the trainer: surplus Ref ranks first,
# then actors, highest id first; joining it: the highest rollout ranks. Colocated: every trainer
# rank is an actor; decoupled: exactly one is a Ref (a Ref already there, else a joining rank,
# else the highest actor). The lowest actor always keeps its role, so the weights have a source.


def manual_refusal(
    roles: tuple[Role, ...], num_rollout: int, num_trainer: int, mode: Mode | None
) -> str | None:
    """Why ``manual_plan`` cannot form this layout from ``roles``, in one line; None if it can.
    IDLE (dead) ranks do not count: the counts must add up to the live ranks."""
    num_live = sum(1 for role in roles if role is not Role.IDLE)
    if num_rollout < 1:
        return f"--rollout {num_rollout}: at least one rollout rank is needed"
    if num_trainer < 1:
        return f"--trainer {num_trainer}: at least one trainer rank is needed"
    if num_rollout + num_trainer != num_live:
        return (f"--rollout {num_rollout} + --trainer {num_trainer} = "
                f"{num_rollout + num_trainer}, but the job has {num_live} live ranks")
    if mode is Mode.DECOUPLED and num_trainer < 2:
        return (f"decoupled needs at least 2 trainer ranks (a Ref and an Actor), "
                f"got --trainer {num_trainer}")
    if Role.ACTOR not in roles:
        return "no actor rank is left to hold the weights"
    return None


def manual_mode(requested: Mode | None, current: Mode, num_trainer: int) -> Mode:
    """The requested mode, else the current one where the trainer can run it."""
    if requested is not None:
        return requested
    return current if num_trainer >= 2 else Mode.COLOCATED


def _manual_trainer_set(roles: tuple[Role, ...], num_trainer: int, keep_refs: int) -> set[int]:
    current = [r for r, role in enumerate(roles) if role in TRAINER_ROLES]
    if num_trainer >= len(current):
        joining = _ranks_with(roles, Role.ROLLOUT)[: num_trainer - len(current)]
        return {*current, *joining}
    refs = _ranks_with(roles, Role.REF)
    num_surplus = max(0, len(refs) - keep_refs)
    leaving = [*refs[:num_surplus], *_ranks_with(roles, Role.ACTOR), *refs[num_surplus:]]
    return set(current) - set(leaving[: len(current) - num_trainer])


def _manual_ref(roles: tuple[Role, ...], trainer: set[int]) -> int:
    """The decoupled plan's Ref rank (``trainer`` holds at least two ranks)."""
    for role in (Role.REF, Role.ROLLOUT, Role.ACTOR):
        ranks = [r for r in sorted(trainer) if roles[r] is role]
        if ranks:
            return ranks[0] if role is Role.REF else ranks[-1]
    raise ValueError("an empty trainer set")


def manual_plan(
    roles: tuple[Role, ...],
    num_rollout: int,
    num_trainer: int,
    mode: Mode | None,
    current_mode: Mode,
    batch_size: int,
) -> ScalingPlan:
    """The operator's layout as a plan (reason MANUAL); ``mode`` None keeps ``current_mode``
    where it can (see ``manual_mode``). ValueError with ``manual_refusal``'s line if refused."""
    refusal = manual_refusal(roles, num_rollout, num_trainer, mode)
    if refusal is not None:
        raise ValueError(refusal)
    mode = manual_mode(mode, current_mode, num_trainer)
    trainer = _manual_trainer_set(roles, num_trainer, 1 if mode is Mode.DECOUPLED else 0)
    target = [role if role is Role.IDLE or r in trainer else Role.ROLLOUT
              for r, role in enumerate(roles)]
    for rank in trainer:
        target[rank] = Role.ACTOR
    if mode is Mode.DECOUPLED:
        target[_manual_ref(roles, trainer)] = Role.REF
    changes = tuple(RoleChange(rank, old, new)
                    for rank, (old, new) in enumerate(zip(roles, target, strict=True))
                    if old is not new)
    return ScalingPlan(changes, mode, batch_size, PlanReason.MANUAL)
