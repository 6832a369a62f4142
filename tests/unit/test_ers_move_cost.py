"""ERS's payback gate: a signal-driven move is made only if it could win back, within its trial,
the time a move that way was measured to add to its boundary
(``step_control.inputs.move_costs``)."""

from dataclasses import replace

import pytest

from tests.unit.test_ers import backlogged, eager, starved
from tests.unit.test_ers_predict import record
from tiderl.core.ers import Direction, ERSConfig, can_pay_back
from tiderl.core.step_control.inputs import move_costs
from tiderl.core.types import PlanReason, Role, RoleChange

R, A = Role.ROLLOUT, Role.ACTOR
TO_ROLLOUT, TO_TRAINER = Direction.TO_ROLLOUT, Direction.TO_TRAINER


# T_step is 60 s in these inputs and trial_steps 2. A move to rollout can win at most the
# trainer's wait (a quarter of the step): 2 x 0.25 x 60 = 30 s. A move to the trainer (a
# backlog: the trainer did not wait) at most its busy time: 2 x 1.0 x 60 = 120 s.
@pytest.mark.parametrize("direction, cost, moves", [
    (TO_ROLLOUT, 29.9, True), (TO_ROLLOUT, 30.0, False),
    (TO_TRAINER, 119.9, True), (TO_TRAINER, 120.0, False),
])
def test_a_move_is_made_only_if_its_trial_can_win_back_its_measured_cost(direction, cost, moves):
    inp = starved("RRAA", trainer_idle_frac=0.25) if direction is TO_ROLLOUT \
        else backlogged("RRAA")
    inp = replace(inp, move_cost_s=((direction, cost),))
    assert can_pay_back(inp, ERSConfig(trial_steps=2), direction) is moves
    result = eager(trial_steps=2).plan(inp)
    expected = RoleChange(3, A, R) if direction is TO_ROLLOUT else RoleChange(1, R, A)
    assert result.changes == ((expected,) if moves else ())
    assert result.reason is (PlanReason.GENERATION_DEFICIT if direction is TO_ROLLOUT
                             else PlanReason.CONSUMPTION_DEFICIT)


def test_only_the_measured_direction_is_gated_and_no_trial_means_no_gate():
    costly = ((TO_TRAINER, 1000.0),)
    to_rollout = replace(starved("RRAA", trainer_idle_frac=0.25), move_cost_s=costly)
    assert eager(trial_steps=2).plan(to_rollout).changes == (RoleChange(3, A, R),)
    to_trainer = replace(backlogged("RRAA"), move_cost_s=costly)
    assert eager(trial_steps=2).plan(to_trainer).changes == ()
    assert eager(trial_steps=0).plan(to_trainer).changes == (RoleChange(1, R, A),)


def test_move_costs_are_a_moves_boundary_gap_less_the_median_still_gap():
    # each step starts 1 s before it ends, so a boundary's gap is the next end less 1 less
    # this end: 9 s where nothing moved; the boundary before step 3 moved rank 1 to the
    # trainer (12 s: 3 s more), the one before step 5 moved it back (10 s: 1 s more), the one
    # before step 6 moved a rank each way (not counted); an idle rank is no move.
    ends = [10, 20, 30, 43, 53, 64, 74, 84]
    layouts = ["RRAA", "RRAA", "RRAA", "RAAA", "RAAA", "RRAA", "ARRA", "ARRA"]
    records = [record(i, float(end), roles=layout) for i, (end, layout)
               in enumerate(zip(ends, layouts, strict=True))]
    assert move_costs(records) == ((TO_ROLLOUT, 1.0), (TO_TRAINER, 3.0))
    assert move_costs(records[:3]) == ()  # nothing moved yet: no cost known
    idle = replace(records[1], roles=("rollout", "rollout", "actor", "idle"))
    assert move_costs([records[0], idle, records[2]]) == ()
