from dataclasses import dataclass, field

import pytest

from tiderl.core.config import ConfigError
from tiderl.core.ers import (
    Block,
    Direction,
    ERSConfig,
    ERSInput,
    ERSPolicy,
    ERSState,
    Trial,
    classify,
    decoupled_break_even,
    elastic_batch_size,
    num_eval_ranks,
    plan_step,
)
from tiderl.core.job import BatchBounds, JobShape
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

T = Ra2pTimings(t_ref=1.0, t_act_f=1.0, t_act_b=2.0, t_swap=0.5)  # actor busy time 3.0
NUM_MB = 16
BATCH = BatchBounds(min=32, ideal=64)  # samples
R, F, A = Role.ROLLOUT, Role.REF, Role.ACTOR  # F: reF
ROLES = {"R": R, "F": F, "A": A, "I": Role.IDLE}
GEN = PlanReason.GENERATION_DEFICIT
CONS = PlanReason.CONSUMPTION_DEFICIT
EVAL = PlanReason.EVALUATION
TRIAL, REVERT = PlanReason.TRIAL, PlanReason.REVERT
COL, DEC = Placement.COLOCATED, Placement.DECOUPLED
TO_ROLLOUT, TO_TRAINER = Direction.TO_ROLLOUT, Direction.TO_TRAINER


def eager(ra2p: RA2PConfig | None = None, **config) -> ERSPolicy:
    """A policy that moves at the first boundary of a deficit (``confirm_steps=1``), for the
    tests of what a deficit moves; the confirmation has tests of its own."""
    return ERSPolicy(ERSConfig(**{"confirm_steps": 1, **config}), ra2p)


def roles(layout: str) -> tuple[Role, ...]:
    return tuple(ROLES[c] for c in layout)


def make_input(
    layout: str | tuple[Role, ...],
    placement: Placement = COL,
    *,
    step: int = 5,
    is_eval: bool = False,
    ras: int = 0,
    tprm: float | None = None,
    hol: float = 0.0,
    volume: int = 0,
    rollout_idle_frac: float = 0.0,
    trainer_idle_frac: float = 0.0,
    goodput: tuple[float, ...] = (),
    phase_tasks: int = 0,
    tasks_per_rank: float = 0.0,
    is_phase_over: bool = False,
    colocated_timings: Ra2pTimings | None = None,
) -> ERSInput:
    signals = ReadinessSignals(ras, tprm, hol, volume, volume * 100)
    layout = roles(layout) if isinstance(layout, str) else layout
    return ERSInput(
        step, is_eval, signals, 60.0, layout, placement, T, NUM_MB, BATCH,
        rollout_idle_frac=rollout_idle_frac, trainer_idle_frac=trainer_idle_frac,
        goodput=goodput, phase_tasks=phase_tasks, tasks_per_rank=tasks_per_rank,
        is_phase_over=is_phase_over, colocated_timings=colocated_timings,
    )


def starved(layout, placement: Placement = COL, *, trainer_idle_frac: float = 0.5,
            **kw) -> ERSInput:
    """Generation deficit: little ready, nothing at the start, no post-start gap seen, and the
    trainer waited for data half of the last step."""
    return make_input(layout, placement, ras=0, tprm=None, hol=0.0, volume=16,
                      trainer_idle_frac=trainer_idle_frac, **kw)


def backlogged(layout, placement: Placement = COL, *, ras: int = 0, **kw) -> ERSInput:
    """Consumption deficit: a full batch ready and its head older than tau·T_step (60 s)."""
    return make_input(layout, placement, ras=ras, tprm=None, hol=100.0, volume=64, **kw)


def throttled(layout, placement: Placement = COL, **kw) -> ERSInput:
    """Rollout idle half of the last step (a full staleness window) while the trainer did not
    wait: a backlog although the buffer's head is young."""
    return make_input(layout, placement, ras=0, tprm=None, hol=0.0, volume=16,
                      rollout_idle_frac=0.5, **kw)


def balanced(layout, placement: Placement = COL, **kw) -> ERSInput:
    return make_input(layout, placement, ras=0, tprm=10.0, hol=1.0, volume=64, **kw)


def plan(*changes: tuple[int, Role, Role], placement: Placement, batch: int, reason: PlanReason):
    return ScalingPlan(tuple(RoleChange(*c) for c in changes), placement, batch, reason)


def apply(layout: tuple[Role, ...], result: ScalingPlan) -> tuple[Role, ...]:
    new = list(layout)
    for change in result.changes:
        assert new[change.rank] is change.src
        new[change.rank] = change.dst
    return tuple(new)


# --------------------------------------------------------------------------- phases


def test_cold_start_maximises_rollout():
    result = eager().plan(make_input("RRRRFAAA", DEC, step=0, volume=0))
    assert result == plan(
        (4, F, R), (7, A, R), (6, A, R), placement=COL, batch=64, reason=PlanReason.COLD_START
    )


def test_cold_start_ends_when_batch_0_is_ready_even_during_an_evaluation():
    # The cold start's plan and the one at its end are both step 0's; ``is_phase_over`` (batch
    # 0 is ready) brings the lent ranks back before step 0 trains, evaluation or not.
    for is_eval in (False, True):
        policy = eager()
        launch = policy.plan(make_input("RRRRFAAA", DEC, step=0, is_eval=is_eval))
        assert launch.reason is PlanReason.COLD_START
        layout = apply(roles("RRRRFAAA"), launch)
        assert policy.state == ERSState(saved_roles=roles("RRRRFAAA"), saved_placement=DEC)
        end = policy.plan(make_input(layout, COL, step=0, is_eval=is_eval, volume=64,
                                     is_phase_over=True))
        assert end == plan((4, R, F), (6, R, A), (7, R, A), placement=DEC, batch=64,
                           reason=PlanReason.PHASE_END)
        assert policy.state == ERSState()


def test_cold_start_at_launch_is_undone_for_the_next_step():
    policy = eager()
    launch = policy.plan(make_input("RRRRFAAA", DEC, step=0, volume=0))
    assert launch.reason is PlanReason.COLD_START
    layout = apply(roles("RRRRFAAA"), launch)
    assert layout == roles("RRRRRARR")
    first = policy.plan(balanced(layout, COL, step=1))
    assert first == plan((4, R, F), (6, R, A), (7, R, A), placement=DEC, batch=64,
                         reason=PlanReason.PHASE_END)
    assert apply(layout, first) == roles("RRRRFAAA")


@pytest.mark.parametrize(
    "phase_tasks, tasks_per_rank, expected",
    [(400, 150.0, 3), (450, 150.0, 3), (451, 150.0, 4), (0, 150.0, 1), (400, 0.0, 1)],
)
def test_num_eval_ranks_is_the_ranks_the_tasks_fill(phase_tasks, tasks_per_rank, expected):
    inp = make_input("RRAAAAAA", is_eval=True, phase_tasks=phase_tasks,
                     tasks_per_rank=tasks_per_rank)
    assert num_eval_ranks(inp, None) == expected


def test_num_eval_ranks_counts_the_ranks_already_lent():
    saved = roles("RRFAAAAA")
    lent = make_input("RRRAARRR", is_eval=True, phase_tasks=400, tasks_per_rank=150.0)
    assert num_eval_ranks(lent, saved) == 0  # ranks 2 (its Ref), 5, 6, 7: 4 lent, 3 wanted
    more = make_input("RRAAARRR", is_eval=True, phase_tasks=600, tasks_per_rank=150.0)
    assert num_eval_ranks(more, saved) == 1


def test_evaluation_lends_as_many_ranks_as_its_tasks_fill():
    policy = eager(max_eval_lend=1.0)
    first = policy.plan(make_input("RRAAAAAA", is_eval=True, volume=64, phase_tasks=400,
                                   tasks_per_rank=150.0))
    assert first == plan((7, A, R), (6, A, R), (5, A, R), placement=COL, batch=64, reason=EVAL)
    assert policy.state == ERSState(saved_roles=roles("RRAAAAAA"), saved_placement=COL)
    # the same tasks: the lent ranks already hold them
    held = policy.plan(make_input("RRAAARRR", is_eval=True, volume=64, phase_tasks=400,
                                  tasks_per_rank=150.0))
    assert held == plan(placement=COL, batch=64, reason=EVAL)
    # more unfinished tasks than the lent ranks hold: one more rank
    grown = policy.plan(make_input("RRAAARRR", is_eval=True, volume=64, phase_tasks=600,
                                   tasks_per_rank=150.0))
    assert grown == plan((4, A, R), placement=COL, batch=64, reason=EVAL)
    after = policy.plan(balanced("RRAARRRR"))
    assert after == plan((4, R, A), (5, R, A), (6, R, A), (7, R, A), placement=COL, batch=64,
                         reason=PlanReason.PHASE_END)
    assert policy.state == ERSState()


@pytest.mark.parametrize("phase_tasks, tasks_per_rank", [(0, 150.0), (400, 0.0)])
def test_evaluation_without_known_tasks_lends_one_rank(phase_tasks, tasks_per_rank):
    result = eager().plan(make_input("RRRRAAAA", is_eval=True, volume=64,
                                         phase_tasks=phase_tasks, tasks_per_rank=tasks_per_rank))
    assert result == plan((7, A, R), placement=COL, batch=64, reason=EVAL)


def test_evaluation_lends_at_most_its_share_of_the_trainer():
    # 1,200 tasks at 150 per rank want 8 ranks; half of the 6 trainer ranks is 3
    policy = eager()
    first = policy.plan(make_input("RRAAAAAA", is_eval=True, volume=64, phase_tasks=1200,
                                   tasks_per_rank=150.0))
    assert first == plan((7, A, R), (6, A, R), (5, A, R), placement=COL, batch=64, reason=EVAL)
    held = policy.plan(make_input("RRAAARRR", is_eval=True, volume=64, phase_tasks=1200,
                                  tasks_per_rank=150.0))
    assert held == plan(placement=COL, batch=64, reason=EVAL)
    assert num_eval_ranks(make_input("RRRRRRRA", is_eval=True, phase_tasks=1200,
                                     tasks_per_rank=150.0), None, 0.5) == 1  # at least one


def test_evaluation_lends_down_to_the_trainer_minimum():
    policy = eager(min_trainer_ranks=2, max_eval_lend=1.0)
    result = policy.plan(make_input("RRRRAAAA", is_eval=True, volume=64, phase_tasks=400,
                                    tasks_per_rank=150.0))
    assert result == plan((7, A, R), (6, A, R), placement=COL, batch=64, reason=EVAL)
    # at the minimum a Ref rank cannot leave; colocated placement turns it into an actor
    result = eager(min_trainer_ranks=2).plan(
        make_input("RRAF", DEC, is_eval=True, volume=64))
    assert result == plan((3, F, A), placement=COL, batch=64, reason=EVAL)


def test_idle_ranks_never_move():
    result = eager().plan(make_input("RIAIA", step=0))
    assert result == plan((4, A, R), placement=COL, batch=64, reason=PlanReason.COLD_START)


# --------------------------------------------------------------------------- deficits


def test_generation_deficit_releases_ref_ranks_then_actors():
    policy = eager()
    first = policy.plan(starved("RRRRFAAA", DEC))
    assert first == plan((4, F, R), placement=COL, batch=64, reason=GEN)
    second = policy.plan(starved("RRRRRAAA", COL))
    assert second == plan((7, A, R), placement=COL, batch=64, reason=GEN)


def test_generation_deficit_needs_a_starved_trainer():
    # the trainer waited exactly max_idle_trainer (0.1) of the last step: not starved
    not_starved = starved("RRRRRAAA", trainer_idle_frac=0.1)
    assert eager().plan(not_starved) == plan(placement=COL, batch=64, reason=PlanReason.BALANCED)
    just_starved = starved("RRRRRAAA", trainer_idle_frac=0.11)
    assert eager().plan(just_starved) == plan((7, A, R), placement=COL, batch=64, reason=GEN)


def test_an_empty_boundary_with_a_busy_trainer_is_no_generation_deficit():
    # Tasks wait on their environments, rollout ranks stay busy, a streaming trainer takes every
    # micro-batch as it comes: the buffer is empty at every boundary but the trainer never
    # waits. That is no generation deficit, step after step.
    policy = eager()
    for step in range(5, 10):
        env_wait = make_input("RRRRFAAA", DEC, step=step, volume=0, rollout_idle_frac=0.0,
                              trainer_idle_frac=0.0)
        assert policy.plan(env_wait) == plan(placement=DEC, batch=64, reason=PlanReason.BALANCED)
    assert policy.state == ERSState(recent=(None, None, None))


def test_consumption_deficit_by_hol_joins_an_actor_while_colocated_is_cheaper():
    # RAS 0 < break-even 16 (no TPRM: one gap of T_step): RA2P prefers colocated, so the joining
    # rank is an actor and an existing Ref rank becomes one too
    assert decoupled_break_even(backlogged("RRRRAA"), RA2PConfig()) == 16
    policy = eager()
    first = policy.plan(backlogged("RRRRAA"))
    assert first == plan((3, R, A), placement=COL, batch=64, reason=CONS)
    second = policy.plan(backlogged("RRRFAA", DEC))
    assert second == plan((2, R, A), (3, F, A), placement=COL, batch=64, reason=CONS)


def test_consumption_deficit_by_hol_at_the_break_even_provisions_a_ref_rank_then_actors():
    policy = eager()
    first = policy.plan(backlogged("RRRRAA", ras=16))
    assert first == plan((3, R, F), placement=DEC, batch=64, reason=CONS)
    second = policy.plan(backlogged("RRRFAA", DEC, ras=16))
    assert second == plan((2, R, A), placement=DEC, batch=64, reason=CONS)


def test_fixed_decoupled_placement_provisions_a_ref_rank_below_the_break_even():
    policy = eager(RA2PConfig(placement="decoupled"))
    first = policy.plan(backlogged("RRRRAA"))
    assert first == plan((3, R, F), placement=DEC, batch=64, reason=CONS)
    second = policy.plan(backlogged("RRRFAA", DEC))
    assert second == plan((2, R, A), placement=DEC, batch=64, reason=CONS)


def test_colocated_timings_set_the_break_even():
    # TPRM 10 s: with the decoupled layout's timings for both sides decoupled needs RAS 11; the
    # colocated layout's own timings (5 s swaps) make colocated dear, and decoupled wins at 0
    dear_swaps = Ra2pTimings(t_ref=1.0, t_act_f=1.0, t_act_b=2.0, t_swap=5.0)
    same = make_input("RRRRAA", ras=0, tprm=10.0, hol=100.0, volume=64)
    own = make_input("RRRRAA", ras=0, tprm=10.0, hol=100.0, volume=64,
                     colocated_timings=dear_swaps)
    assert decoupled_break_even(same, RA2PConfig()) == 11
    assert decoupled_break_even(own, RA2PConfig()) == 0
    assert eager().plan(same) == plan((3, R, A), placement=COL, batch=64, reason=CONS)
    assert eager().plan(own) == plan((3, R, F), placement=DEC, batch=64, reason=CONS)


def test_consumption_deficit_by_ras_at_the_break_even():
    assert break_even_ras(NUM_MB, 10.0, T, 8) == 11  # long TPRM: decoupled needs a backlog
    at_break_even = make_input("RRRRAA", ras=11, tprm=10.0, hol=1.0, volume=40)
    assert eager().plan(at_break_even) == plan((3, R, F), placement=DEC, batch=40, reason=CONS)
    below = make_input("RRRRAA", ras=10, tprm=10.0, hol=1.0, volume=40, trainer_idle_frac=0.5)
    assert eager().plan(below) == plan((5, A, R), placement=COL, batch=64, reason=GEN)
    fed = make_input("RRRRAA", ras=10, tprm=10.0, hol=1.0, volume=40, trainer_idle_frac=0.0)
    assert eager().plan(fed) == plan(placement=COL, batch=64, reason=PlanReason.BALANCED)


def test_short_tprm_asks_for_decoupled_and_more_trainer_ranks():
    # TPRM 2 s < actor time 3 s: micro-batches arrive faster than the trainer consumes them, so
    # even with a young buffer head (HoL 1 s) a Ref rank comes first, then actors.
    assert break_even_ras(NUM_MB, 2.0, T, 8) == 0
    flowing = make_input("RRRRAA", ras=0, tprm=2.0, hol=1.0, volume=16)
    assert eager().plan(flowing) == plan((3, R, F), placement=DEC, batch=32, reason=CONS)
    flowing = make_input("RRRFAA", DEC, ras=0, tprm=2.0, hol=1.0, volume=16)
    assert eager().plan(flowing) == plan((2, R, A), placement=DEC, batch=32, reason=CONS)


def test_ras_at_the_break_even_without_a_backlog_only_provisions_the_ref_rank():
    # TPRM 3.5 s > actor time 3 s and HoL 1 s: no backlog; RAS 0 >= break-even 0 asks for the
    # decoupled placement only, so a Ref rank is provisioned once and nothing more moves.
    assert break_even_ras(NUM_MB, 3.5, T, 8) == 0
    paced = make_input("RRRRAA", ras=0, tprm=3.5, hol=1.0, volume=16)
    assert eager().plan(paced) == plan((3, R, F), placement=DEC, batch=32, reason=CONS)
    paced = make_input("RRRFAA", DEC, ras=0, tprm=3.5, hol=1.0, volume=16)
    assert eager().plan(paced) == plan(placement=DEC, batch=64, reason=CONS)


def test_idle_rollout_with_a_waiting_trainer_moves_nothing():
    # the same starved buffer, but rollout sat idle half of the last step: more rollout ranks
    # would not produce more, and with the trainer waiting too there is no backlog either
    idle = starved("RRRRFAAA", DEC, rollout_idle_frac=0.5, trainer_idle_frac=0.5)
    assert classify(idle, ERSConfig(), RA2PConfig()) is PlanReason.BALANCED
    assert eager().plan(idle) == plan(placement=DEC, batch=64, reason=PlanReason.BALANCED)
    busy = starved("RRRRFAAA", DEC, rollout_idle_frac=0.1, trainer_idle_frac=0.5)
    assert eager().plan(busy) == plan((4, F, R), placement=COL, batch=64, reason=GEN)


def test_idle_rollout_with_a_busy_trainer_is_a_backlog():
    # Rollout ranks idle on a full staleness window while the trainer never waited: the trainer
    # is the bottleneck. RAS 0 < break-even 16: the joining rank is an actor, the Ref rank too.
    expected = plan((3, R, A), (4, F, A), placement=COL, batch=32, reason=CONS)
    assert eager().plan(throttled("RRRRFAAA", DEC)) == expected
    at_limit = throttled("RRRRFAAA", DEC, trainer_idle_frac=0.1)  # waited max_idle_trainer
    assert eager().plan(at_limit) == expected
    # step 0 has no last step whose idle share could say so
    launch = throttled("RRRRFAAA", DEC, step=0)
    assert eager(cold_start_steps=0).plan(launch) == plan(
        placement=DEC, batch=64, reason=PlanReason.BALANCED)


def test_balanced_keeps_everything():
    inp = balanced("RRRRAA")
    assert classify(inp, ERSConfig(), RA2PConfig()) is PlanReason.BALANCED
    assert eager().plan(inp) == plan(placement=COL, batch=64, reason=PlanReason.BALANCED)


def test_scale_up_is_bounded_per_step():
    inp = backlogged("RRRRRAA")
    assert eager().plan(inp) == plan((4, R, A), placement=COL, batch=64, reason=CONS)
    policy = eager(max_scale_up_per_step=2)
    assert policy.plan(inp) == plan((4, R, A), (3, R, A), placement=COL, batch=64, reason=CONS)
    inp = backlogged("RRRRRAA", ras=16)
    assert eager().plan(inp) == plan((4, R, F), placement=DEC, batch=64, reason=CONS)
    policy = eager(max_scale_up_per_step=2)
    assert policy.plan(inp) == plan((4, R, F), (3, R, A), placement=DEC, batch=64, reason=CONS)


def test_min_ranks_are_respected():
    # no rollout rank to spare: an actor becomes the Ref rank if another actor remains, and
    # only where decoupled is cheaper (RAS 16 >= break-even 16)
    at_break_even = backlogged("RAA", ras=16)
    assert eager().plan(at_break_even) == plan((2, A, F), placement=DEC, batch=64, reason=CONS)
    assert eager().plan(backlogged("RAA")) == plan(placement=COL, batch=64, reason=CONS)
    assert eager().plan(backlogged("RA", ras=16)) == plan(placement=COL, batch=64, reason=CONS)
    policy = eager(min_rollout_ranks=3)
    assert policy.plan(backlogged("RRRAA", ras=16)) == plan(
        (4, A, F), placement=DEC, batch=64, reason=CONS)
    # the trainer keeps min_trainer_ranks and at least one actor
    assert eager().plan(starved("RRRA")) == plan(placement=COL, batch=64, reason=GEN)
    policy = eager(min_trainer_ranks=2)
    assert policy.plan(starved("RRAA")) == plan(placement=COL, batch=64, reason=GEN)


def test_fixed_colocated_mode_never_creates_ref_ranks():
    policy = eager(RA2PConfig(placement="colocated"))
    assert policy.plan(backlogged("RRRAA", ras=16)) == plan(
        (2, R, A), placement=COL, batch=64, reason=CONS)
    assert policy.plan(backlogged("RRRFA", DEC, ras=16)) == plan(
        (2, R, A), (3, F, A), placement=COL, batch=64, reason=CONS)


# --------------------------------------------------------------------------- batch size


def test_elastic_batch_size():
    batch = BatchBounds(min=32, ideal=64)
    assert elastic_batch_size(100, batch, is_retaining=False) == 64
    assert elastic_batch_size(100, batch, is_retaining=True) == 64
    assert elastic_batch_size(10, batch, is_retaining=False) == 64  # an empty boundary is normal
    assert elastic_batch_size(40, batch, is_retaining=True) == 40
    assert elastic_batch_size(10, batch, is_retaining=True) == 32


def test_adaptive_retention_is_the_step_after_a_rollout_scale_down():
    policy = eager()
    paced = make_input("RRRFAA", DEC, ras=0, tprm=3.5, hol=1.0, volume=40)  # no moves
    assert policy.plan(paced).batch_size == 64
    scaled = policy.plan(make_input("RRRFAA", DEC, tprm=2.0, hol=100.0, volume=40))  # scale-down
    assert scaled.changes == (RoleChange(2, R, A),)
    assert scaled.batch_size == 40  # fetch what is ready while the smaller rollout refills
    assert policy.plan(paced).batch_size == 64


def test_disabled_ers_is_a_noop():
    policy = eager(enabled=False)
    result = policy.plan(make_input("RRRRFAAA", DEC, step=0, volume=3))
    assert result == plan(placement=DEC, batch=64, reason=PlanReason.BALANCED)
    assert result.is_noop


# --------------------------------------------------------------------------- closed loop


@dataclass
class Loop:
    """Plans one step after another, applies each plan, and records each step's goodput; the
    step number is the length of the goodput history (steps 0 .. step - 1 ran)."""

    policy: ERSPolicy
    layout: tuple[Role, ...]
    placement: Placement = COL
    goodput: list[float] = field(default_factory=lambda: [10.0] * 5)

    def step(self, make, goodput: float, **kw) -> ScalingPlan:
        inp = make(self.layout, self.placement, step=len(self.goodput),
                   goodput=tuple(self.goodput), **kw)
        result = self.policy.plan(inp)
        self.layout, self.placement = apply(self.layout, result), result.placement
        self.goodput.append(goodput)
        return result


def reverted_once() -> Loop:
    """Step 5 moves an actor to rollout; steps 5 and 6 train at 9 tok/s, below the 10 of the
    four steps before: step 7 undoes the move and blocks that direction for steps 7-10."""
    loop = Loop(eager(), roles("RRRRRAAA"))
    assert loop.step(starved, 9.0) == plan((7, A, R), placement=COL, batch=64, reason=GEN)
    assert loop.policy.state == ERSState(
        TO_ROLLOUT, trial=Trial(TO_ROLLOUT, (RoleChange(7, A, R),), COL, 5, 10.0))
    # step 6: the move is measured; no signal moves anything, not even the opposite deficit
    assert loop.step(backlogged, 9.0) == plan(placement=COL, batch=64, reason=TRIAL)
    assert loop.step(starved, 10.0) == plan((7, R, A), placement=COL, batch=64, reason=REVERT)
    assert loop.policy.state == ERSState(blocks=(Block(TO_ROLLOUT, 11, 4),))
    assert loop.layout == roles("RRRRRAAA")
    return loop


def test_a_move_that_does_not_raise_goodput_is_reverted_and_its_direction_blocked():
    loop = reverted_once()
    blocked = [loop.step(starved, 10.0) for _ in range(8, 11)]
    assert blocked == [plan(placement=COL, batch=64, reason=GEN)] * 3
    # step 11
    assert loop.step(starved, 10.0) == plan((7, A, R), placement=COL, batch=64, reason=GEN)
    assert loop.policy.state.trial == Trial(TO_ROLLOUT, (RoleChange(7, A, R),), COL, 11, 10.0)


def test_a_blocked_direction_leaves_the_other_one_free():
    loop = reverted_once()
    assert loop.step(backlogged, 10.0) == plan((4, R, A), placement=COL, batch=64, reason=CONS)
    assert loop.policy.state == ERSState(
        TO_TRAINER, trial=Trial(TO_TRAINER, (RoleChange(4, R, A),), COL, 8, 9.5),  # steps 4-7
        blocks=(Block(TO_ROLLOUT, 11, 4),))


def test_a_revert_one_way_keeps_the_other_ways_block():
    loop = reverted_once()  # to rollout: blocked for steps 7-10
    assert loop.step(backlogged, 9.0) == plan((4, R, A), placement=COL, batch=64, reason=CONS)
    assert loop.step(backlogged, 9.0) == plan(placement=COL, batch=64, reason=TRIAL)
    # step 10: 9 is not above the baseline 9.5; both directions are now blocked
    assert loop.step(starved, 9.0) == plan((4, A, R), placement=COL, batch=64, reason=REVERT)
    assert loop.policy.state == ERSState(
        blocks=(Block(TO_ROLLOUT, 11, 4), Block(TO_TRAINER, 14, 4)))
    assert loop.step(backlogged, 9.0) == plan(placement=COL, batch=64, reason=CONS)  # step 11
    assert loop.step(starved, 9.0) == plan((7, A, R), placement=COL, batch=64, reason=GEN)  # 12


def reverted_twice() -> Loop:
    """Past ``reverted_once``: step 11 moves again, steps 11 and 12 train at exactly the
    baseline (not above it), so step 13 reverts and blocks for twice as long: steps 13-20."""
    loop = reverted_once()
    for _ in range(8, 11):
        loop.step(starved, 10.0)
    assert loop.step(starved, 10.0) == plan((7, A, R), placement=COL, batch=64, reason=GEN)
    assert loop.step(starved, 10.0) == plan(placement=COL, batch=64, reason=TRIAL)
    assert loop.step(starved, 10.0) == plan((7, R, A), placement=COL, batch=64, reason=REVERT)
    assert loop.policy.state == ERSState(blocks=(Block(TO_ROLLOUT, 21, 8),))
    return loop


def test_a_second_revert_in_a_row_blocks_twice_as_long():
    loop = reverted_twice()
    blocked = [loop.step(starved, 10.0) for _ in range(14, 21)]
    assert blocked == [plan(placement=COL, batch=64, reason=GEN)] * 7
    # step 21
    assert loop.step(starved, 12.0) == plan((7, A, R), placement=COL, batch=64, reason=GEN)


def test_the_block_doubles_up_to_64_steps():
    trial = Trial(TO_ROLLOUT, (RoleChange(7, A, R),), COL, 30, 10.0)
    for block_steps in (48, 64):
        state = ERSState(TO_ROLLOUT, trial=trial, blocks=(Block(TO_ROLLOUT, 30, block_steps),))
        inp = starved("RRRRRAAR", step=32, goodput=(10.0,) * 32)
        result, state = plan_step(inp, state, ERSConfig(), RA2PConfig())
        assert result == plan((7, R, A), placement=COL, batch=64, reason=REVERT)
        assert state == ERSState(blocks=(Block(TO_ROLLOUT, 96, 64),))


def test_a_move_that_raises_goodput_is_kept():
    loop = Loop(eager(), roles("RRRRRAAA"))
    assert loop.step(starved, 12.0) == plan((7, A, R), placement=COL, batch=64, reason=GEN)
    assert loop.step(starved, 11.0) == plan(placement=COL, batch=64, reason=TRIAL)
    # step 7: 11.5 > 10; the judgement leaves the step to its signals
    assert loop.step(balanced, 11.0) == plan(placement=COL, batch=64, reason=PlanReason.BALANCED)
    assert loop.policy.state == ERSState(TO_ROLLOUT, (None,))
    assert loop.layout == roles("RRRRRAAR")


def test_a_kept_move_lifts_its_directions_block():
    loop = reverted_twice()
    for _ in range(14, 21):
        loop.step(starved, 10.0)
    loop.step(starved, 12.0)  # step 21: (7, A, R) on trial against the baseline 10
    assert loop.step(starved, 12.0) == plan(placement=COL, batch=64, reason=TRIAL)
    # step 23: 12 > 10 keeps the move and lifts the block; the deficit moves the next actor at
    # once, on trial against steps 19-22
    assert loop.step(starved, 11.0) == plan((6, A, R), placement=COL, batch=64, reason=GEN)
    assert loop.policy.state == ERSState(
        TO_ROLLOUT, trial=Trial(TO_ROLLOUT, (RoleChange(6, A, R),), COL, 23, 11.0))
    assert loop.step(starved, 11.0) == plan(placement=COL, batch=64, reason=TRIAL)
    # step 25: 11 is not above 11; the block starts over at damp_steps
    assert loop.step(starved, 11.0) == plan((6, R, A), placement=COL, batch=64, reason=REVERT)
    assert loop.policy.state == ERSState(blocks=(Block(TO_ROLLOUT, 29, 4),))


def test_a_revert_restores_the_mode_and_skips_ranks_that_moved_on():
    loop = Loop(eager(), roles("RRRRFAAA"), DEC)
    moved = loop.step(throttled, 9.0)
    assert moved == plan((3, R, A), (4, F, A), placement=COL, batch=32, reason=CONS)
    assert loop.policy.state.trial == Trial(
        TO_TRAINER, (RoleChange(3, R, A), RoleChange(4, F, A)), DEC, 5, 10.0)
    assert loop.step(throttled, 9.0) == plan(placement=COL, batch=64, reason=TRIAL)
    loop.layout = roles("RRRIAAAA")  # rank 3 failed during the trial
    assert loop.step(throttled, 9.0) == plan((4, A, F), placement=DEC, batch=64, reason=REVERT)
    assert loop.policy.state == ERSState(blocks=(Block(TO_TRAINER, 11, 4),))
    assert loop.step(throttled, 9.0) == plan(placement=DEC, batch=64, reason=CONS)  # blocked
    assert loop.step(starved, 9.0) == plan((4, F, R), placement=COL, batch=64, reason=GEN)


def test_a_move_is_not_on_trial_without_goodput_to_compare_with():
    policy = eager()
    assert policy.plan(starved("RRRRRAAA")) == plan((7, A, R), placement=COL, batch=64, reason=GEN)
    assert policy.state == ERSState(TO_ROLLOUT)
    policy = eager(trial_steps=0)
    assert policy.plan(starved("RRRRRAAA", goodput=(10.0,) * 5)).changes == (
        RoleChange(7, A, R),)
    assert policy.state == ERSState(TO_ROLLOUT)
    next_step = starved("RRRRRAAR", step=6, goodput=(10.0,) * 6)
    assert policy.plan(next_step) == plan((6, A, R), placement=COL, batch=64, reason=GEN)


def test_no_move_before_a_step_after_step_0_ran():
    # at the boundary after step 0 only its goodput is known, and its span holds the launch's
    # rollout: a backlog then moves nothing; one step later it does, on trial against step 1
    policy = eager()
    first = backlogged("RRRRAA", step=1, goodput=(3.0,))
    assert policy.plan(first) == plan(placement=COL, batch=64, reason=CONS)
    later = backlogged("RRRRAA", step=2, goodput=(3.0, 10.0))
    assert policy.plan(later) == plan((3, R, A), placement=COL, batch=64, reason=CONS)
    assert policy.state.trial == Trial(TO_TRAINER, (RoleChange(3, R, A),), COL, 2, 10.0)


def test_phases_keep_the_damping():
    loop = reverted_once()
    # step 8: an evaluation lends a rank; step 9: it is over, the rank comes back
    lent = loop.step(make_input, 10.0, is_eval=True, volume=64)
    assert lent == plan((7, A, R), placement=COL, batch=64, reason=EVAL)
    assert loop.policy.state == ERSState(saved_roles=roles("RRRRRAAA"), saved_placement=COL,
                                         blocks=(Block(TO_ROLLOUT, 11, 4),))
    back = loop.step(starved, 10.0)  # 16 ready: the smaller rollout's reservoir is kept
    assert back == plan((7, R, A), placement=COL, batch=32, reason=PlanReason.PHASE_END)
    assert loop.policy.state == ERSState(blocks=(Block(TO_ROLLOUT, 11, 4),))
    assert loop.step(starved, 10.0) == plan(placement=COL, batch=64, reason=GEN)  # step 10: blocked
    assert loop.step(starved, 10.0) == plan((7, A, R), placement=COL, batch=64, reason=GEN)


# --------------------------------------------------------------------------- config


def test_batch_min_above_batch_ideal_is_refused():
    with pytest.raises(ConfigError) as error:
        JobShape(batch_min_groups=10, batch_groups=8)
    assert error.value.key == "batch_min_groups"
    assert error.value.message == "expected <= batch_groups (8), got 10"


@pytest.mark.parametrize(
    "field, value",
    [
        ("tau", 0.0),
        ("max_scale_up_per_step", 0),
        ("confirm_steps", 0),
        ("confirm_window", 1),
        ("hysteresis_steps", 0),
        ("min_rollout_ranks", 0),
        ("min_trainer_ranks", 0),
        ("cold_start_steps", -1),
        ("max_idle_rollout", 1.5),
        ("max_idle_trainer", -0.1),
        ("trial_steps", -1),
        ("damp_steps", -1),
    ],
)
def test_config_fields_are_validated(field, value):
    with pytest.raises(ConfigError) as error:
        ERSConfig(**{field: value})
    assert error.value.key == field


def test_input_is_validated():
    with pytest.raises(ValueError, match="step_duration_s"):
        ERSInput(0, False, ReadinessSignals(0, None, 0.0, 0), -1.0, (), COL, T, 4, BATCH)
