"""ERS reads the trainer's starvation before it moves a rank: its idle shares over
``ers.idle_window`` trailing steps on the current roles (``step_control.inputs``), since a
pipeline held by its staleness window alternates a step in which the trainer waits for data with
one in which rollout idles on the full window, and the second step read alone is a consumption
deficit that the pair does not have; and RAS at RA2P's break-even takes a rollout rank for a Ref
rank only while the trainer did not starve."""

import pytest

from tests.unit.test_ers import eager, make_input
from tests.unit.test_ers_predict import record
from tiderl.core.config import ConfigError
from tiderl.core.ers import ERSConfig, ERSPolicy, classify
from tiderl.core.job import BatchBounds
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.step_control.inputs import ers_input, rollout_idle_frac, trainer_idle_frac
from tiderl.core.types import Placement, PlanReason, ReadinessSignals, Role

R, A = Role.ROLLOUT, Role.ACTOR


def alternating(num_steps: int) -> list:
    """1 s steps on 2 rollout and 2 trainer ranks: even steps the trainer waits 1.6 of its 2
    rank-seconds and rollout idles 0.6 (its tasks wait for their environments), odd steps
    rollout idles 1.2 of its 2 on the full window and the trainer never waits."""
    return [record(i, float(i + 1), twt_s=1.6 if i % 2 == 0 else 0.0,
                   rwt_s=0.6 if i % 2 == 0 else 1.2) for i in range(num_steps)]


def test_the_idle_shares_are_the_waits_over_the_capacity_of_the_trailing_steps():
    records = alternating(4)
    assert trainer_idle_frac(records, 1) == 0.0
    assert rollout_idle_frac(records, 1) == pytest.approx(0.6)
    assert trainer_idle_frac(records, 2) == pytest.approx(1.6 / 4)
    assert rollout_idle_frac(records, 3) == pytest.approx(3.0 / 6)
    assert trainer_idle_frac(records, 10) == pytest.approx(3.2 / 8)  # all there are
    assert trainer_idle_frac([], 3) == 0.0


def test_only_the_steps_on_the_last_steps_roles_count():
    records = alternating(4)
    records[-1] = record(3, 4.0, roles="RAAA", rwt_s=0.3)  # a rank moved to the trainer
    assert rollout_idle_frac(records, 3) == pytest.approx(0.3)  # 0.3 of 1 rank-second
    assert trainer_idle_frac(records, 3) == 0.0


def input_after(records: list, config: ERSConfig):
    """What ERS reads at the boundary after ``records`` (a young, part-full buffer: only the
    idle shares can make a deficit)."""
    return ers_input(step=len(records), is_eval_step=False,
                     signals=ReadinessSignals(0, None, 0.0, 8), records=records,
                     roles=[R, R, A, A], placement=Placement.COLOCATED, measured={},
                     batch=BatchBounds(8, 32), idle_steps=config.idle_window)


def plan_after(records: list, config: ERSConfig) -> PlanReason:
    return classify(input_after(records, config), config, RA2PConfig())


def test_an_alternating_pipeline_is_balanced_over_the_window_and_a_backlog_read_alone():
    records = alternating(6)
    assert plan_after(records, ERSConfig(idle_window=1)) is PlanReason.CONSUMPTION_DEFICIT
    assert plan_after(records, ERSConfig(idle_window=3)) is PlanReason.BALANCED
    assert plan_after(records, ERSConfig()) is PlanReason.BALANCED  # the default reads 3


def test_a_trainer_that_never_waits_is_backlogged_over_any_window():
    records = [record(i, float(i + 1), rwt_s=1.2) for i in range(6)]
    for window in (1, 3, 6):
        assert plan_after(records, ERSConfig(idle_window=window)) \
            is PlanReason.CONSUMPTION_DEFICIT


def test_the_window_moves_no_rank_on_the_alternation_where_one_step_did():
    records = alternating(8)
    moves = {}
    for window in (1, 3):
        config = ERSConfig(idle_window=window, trial_steps=0)
        policy = ERSPolicy(config)
        for end in range(5, 9):  # four boundaries read, two of them needed
            changes = policy.plan(input_after(records[:end], config)).changes
            if changes:
                break
        moves[window] = changes
    assert [c.dst for c in moves[1]] == [A]
    assert moves[3] == ()


def test_an_idle_window_below_one_step_is_refused():
    with pytest.raises(ConfigError, match="idle_window"):
        ERSConfig(idle_window=0)


def test_ras_at_the_break_even_takes_no_rollout_rank_from_a_starved_trainer():
    # RAS 0 >= break-even 0 (TPRM 2 s < the actor's 3 s) asks for a Ref rank; with the trainer
    # waiting for data half its time (rollout idle too: no generation deficit) that is no
    # trainer-side pressure, and the rollout rank stays
    flowing = make_input("RRRRAA", ras=0, tprm=2.0, hol=1.0, volume=16,
                         rollout_idle_frac=0.5, trainer_idle_frac=0.5)
    assert classify(flowing, ERSConfig(), RA2PConfig()) is PlanReason.BALANCED
    assert eager().plan(flowing).changes == ()
    fed = make_input("RRRRAA", ras=0, tprm=2.0, hol=1.0, volume=16, rollout_idle_frac=0.5,
                     trainer_idle_frac=0.1)  # waited max_idle_trainer: not starved
    assert [c.dst for c in eager().plan(fed).changes] == [Role.REF]


def test_without_signal_moves_a_deficit_is_read_and_moves_nothing():
    # the starved, busy-rollout input that moves a trainer rank to rollout by default
    starved_busy = make_input("RRAA", volume=16, trainer_idle_frac=0.5)
    assert [c.dst for c in eager().plan(starved_busy).changes] == [R]
    plan = eager(signal_moves=False).plan(starved_busy)
    assert (plan.reason, plan.changes) == (PlanReason.GENERATION_DEFICIT, ())
