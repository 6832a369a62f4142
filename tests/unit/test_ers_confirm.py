"""ERS's confirmation and hysteresis: a deficit must be read at ``confirm_steps`` of the last
``confirm_window`` boundaries (``hysteresis_steps`` to reverse the last move), never with the
opposite one among them; phases reset this memory. The helpers are test_ers.py's."""

import pytest

from tests.unit.test_ers import (
    COL,
    CONS,
    DEC,
    EVAL,
    GEN,
    TO_ROLLOUT,
    TO_TRAINER,
    A,
    F,
    R,
    apply,
    backlogged,
    balanced,
    eager,
    make_input,
    plan,
    roles,
    starved,
)
from tiderl.core.ers import Direction, ERSConfig, ERSPolicy, ERSState
from tiderl.core.types import PlanReason, RoleChange, ScalingPlan


def test_a_deficit_moves_ranks_at_its_second_boundary_of_three():
    policy = ERSPolicy()
    assert policy.plan(starved("RRRRRAAA")) == plan(placement=COL, batch=64, reason=GEN)
    assert policy.state == ERSState(recent=(TO_ROLLOUT,))
    assert policy.plan(balanced("RRRRRAAA", step=6)).changes == ()  # it comes back:
    third = policy.plan(starved("RRRRRAAA", step=7))
    assert third == plan((7, A, R), placement=COL, batch=64, reason=GEN)
    assert policy.state == ERSState(TO_ROLLOUT)


def test_a_deficit_once_in_three_boundaries_moves_nothing():
    policy = ERSPolicy()
    for step, make in enumerate((backlogged, balanced, balanced, backlogged), start=5):
        assert policy.plan(make("RRRRAA", step=step)).changes == ()
    assert policy.state == ERSState(recent=(None, None, TO_TRAINER))


def test_the_other_deficit_in_the_window_holds_a_move():
    policy = ERSPolicy()
    for step, make in enumerate((backlogged, starved, backlogged), start=5):
        assert policy.plan(make("RRRRAA", step=step)).changes == ()
    assert policy.state == ERSState(recent=(TO_TRAINER, TO_ROLLOUT, TO_TRAINER))


@pytest.mark.parametrize(("make_policy", "moves_at_step_2"), [(ERSPolicy, False), (eager, True)])
def test_the_backlog_a_cold_start_leaves_behind_moves_nothing(make_policy, moves_at_step_2):
    # The gui benchmark's trace: the rank lent to rollout until batch 0 was ready left a
    # backlog (RAS 11) that the step-2 boundary reads as a consumption deficit; the boundary
    # after it is balanced. Acting on the one boundary moved a rollout rank to the trainer,
    # which then starved until the move was reverted.
    policy = make_policy()
    launch = policy.plan(make_input("RRAA", step=0, volume=0))
    assert launch.reason is PlanReason.COLD_START
    layout = apply(roles("RRAA"), launch)
    end = policy.plan(make_input(layout, step=0, volume=64, is_phase_over=True))
    assert end.reason is PlanReason.PHASE_END and apply(layout, end) == roles("RRAA")
    after_launch = policy.plan(backlogged("RRAA", step=1, ras=11, goodput=(1658.0,)))
    assert after_launch == plan(placement=COL, batch=64, reason=CONS)  # no steady step yet
    residue = policy.plan(backlogged("RRAA", step=2, ras=11, goodput=(1658.0, 2334.0)))
    assert residue.reason is CONS and bool(residue.changes) is moves_at_step_2
    if not moves_at_step_2:
        drained = policy.plan(balanced("RRAA", step=3, goodput=(1658.0, 2334.0, 2617.0)))
        assert drained == plan(placement=COL, batch=64, reason=PlanReason.BALANCED)
        assert policy.state == ERSState(recent=(TO_TRAINER, None))



def run_alternating(config: ERSConfig, num_steps: int = 20) -> list[ScalingPlan]:
    """Generation deficit on even steps, consumption deficit on odd ones; plans applied."""
    policy = ERSPolicy(config)
    layout, placement, plans = roles("RRRRRFAA"), DEC, []
    for step in range(num_steps):
        make = starved if step % 2 == 0 else backlogged
        result = policy.plan(make(layout, placement, step=step))
        layout, placement = apply(layout, result), result.placement
        plans.append(result)
    return plans


def test_alternating_signals_do_not_thrash():
    plans = run_alternating(ERSConfig(cold_start_steps=0, confirm_steps=1, hysteresis_steps=2))
    moves = {step: p.changes for step, p in enumerate(plans) if p.changes}
    # step 0: the Ref rank goes to rollout; then every deficit has the other one beside it in
    # the window of three boundaries, and nothing moves again.
    assert moves == {0: (RoleChange(5, F, R),)}
    assert [p.reason for p in plans] == [GEN, CONS] * 10
    assert all(p.placement is COL for p in plans)


def test_without_hysteresis_the_same_signals_thrash():
    plans = run_alternating(ERSConfig(cold_start_steps=0, confirm_steps=1, hysteresis_steps=1))
    assert [p.changes for p in plans[:4]] == [
        (RoleChange(5, F, R),), (RoleChange(5, R, A),), (RoleChange(7, A, R),),
        (RoleChange(7, R, A),),
    ]
    assert sum(len(p.changes) for p in plans) == 20


def test_reversal_after_consecutive_opposite_signals():
    policy = eager(hysteresis_steps=2)
    assert policy.plan(starved("RRRRFAA", DEC)).changes == (RoleChange(4, F, R),)
    assert policy.plan(backlogged("RRRRRAA")).changes == ()
    assert policy.state == ERSState(Direction.TO_ROLLOUT, (Direction.TO_TRAINER,))
    assert policy.plan(backlogged("RRRRRAA")).changes == (RoleChange(4, R, A),)
    assert policy.state == ERSState(Direction.TO_TRAINER)


def test_an_opposite_deficit_must_come_back_within_the_window():
    policy = eager(hysteresis_steps=2)
    policy.plan(starved("RRRRFAA", DEC))
    policy.plan(backlogged("RRRRRAA"))
    policy.plan(balanced("RRRRRAA"))
    policy.plan(balanced("RRRRRAA"))
    assert policy.plan(backlogged("RRRRRAA")) == plan(placement=COL, batch=64, reason=CONS)
    assert policy.state == ERSState(Direction.TO_ROLLOUT, (None, None, Direction.TO_TRAINER))


def test_a_phase_is_undone_at_its_end_and_resets_hysteresis():
    policy = eager(hysteresis_steps=3)
    policy.plan(starved("RRRRFAA", DEC))  # -> RRRRRAA, direction: to rollout
    during = policy.plan(make_input("RRRRRAA", is_eval=True, volume=64))
    assert during == plan((6, A, R), placement=COL, batch=64, reason=EVAL)  # -> RRRRRAR
    again = policy.plan(make_input("RRRRRAR", is_eval=True, volume=64))  # still evaluating
    assert again == plan(placement=COL, batch=64, reason=EVAL)
    after = policy.plan(backlogged("RRRRRAR"))
    assert after == plan((6, R, A), placement=COL, batch=64, reason=PlanReason.PHASE_END)
    assert policy.state == ERSState()
    # the phase cleared the memory of the move to rollout: the next signal acts at once
    moved = policy.plan(backlogged("RRRRRAA"))
    assert moved == plan((4, R, A), placement=COL, batch=64, reason=CONS)
