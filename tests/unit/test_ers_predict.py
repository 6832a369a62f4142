"""ERS's predictive planner: the rate window from step records, the three-bound model, and the
plans it makes through ``plan_step`` (gate, trial and revert as for the rules)."""

import math
from dataclasses import replace

import pytest

from tiderl.core.config import ConfigError
from tiderl.core.ers import Direction, ERSConfig, ERSInput, ERSPolicy, ERSState, Trial
from tiderl.core.ers_predict import (
    RateWindow,
    planned_rollout_ranks,
    predicted_goodput,
    rate_window,
)
from tiderl.core.job import BatchBounds
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.records import StepRecord
from tiderl.core.system import StepMode
from tiderl.core.types import (
    Placement,
    PlanReason,
    Ra2pTimings,
    ReadinessSignals,
    Role,
    RoleChange,
    ScalingPlan,
)

R, A = Role.ROLLOUT, Role.ACTOR
PREDICTED = PlanReason.PREDICTED
PREDICTIVE = ERSConfig(planner="predictive")


def record(step: int, end_s: float, *, roles: str = "RRAA", tokens: int = 1000,
           rwt_s: float = 0.0, twt_s: float = 0.0, saturated_s: float | None = 0.0,
           generating: float | None = None) -> StepRecord:
    names = tuple("rollout" if c == "R" else "actor" for c in roles)
    return StepRecord(
        step=step, start_s=end_s - 1.0, end_s=end_s, trained_tokens=tokens,
        trained_tokens_total=tokens * (step + 1), trained_samples=8,
        generated_tokens_total=0, discarded_tokens_total=0, ras=0, tprm_s=None, rwt_s=rwt_s,
        twt_s=twt_s, step_mode=StepMode.COLOCATED, roles=names, num_rollout=roles.count("R"),
        num_trainer=roles.count("A"), num_micro_batches=2, kv_hit_rate=None, staleness_max=0,
        reward_mean=None, solved_frac=None, eval_reward=None, loss=None, grad_norm=None,
        batch_size=8, ers_reason=None, rollout_saturated_s=saturated_s,
        generating_share=generating)


def window(*, supply: float, demand: float, goodput: float, generating: float = 0.0,
           num_rollout: int = 8, num_trainer: int = 24) -> RateWindow:
    """A 100 s window at these per-rank rates (supply inf: rollout never saturated)."""
    tokens = int(goodput * 100)
    saturated = 0.0 if math.isinf(supply) else tokens / supply
    return RateWindow(2, num_rollout, num_trainer, tokens, 100.0, saturated, tokens / demand,
                      generating)


# --------------------------------------------------------------------------- the window


def test_the_rate_window_sums_the_trailing_steps_on_the_last_layout_without_step_0():
    records = [record(0, 50.0, saturated_s=40.0),  # the launch's span: never measured
               record(1, 60.0, roles="RRRA"),  # another layout: the window stops here
               record(2, 70.0, tokens=2000, rwt_s=3.0, twt_s=4.0, saturated_s=5.0,
                      generating=0.5),
               record(3, 75.0, tokens=1000, twt_s=1.0, saturated_s=2.0, generating=0.2)]
    # trainer busy: 2 ranks x 10 s - 4 s, then 2 x 5 s - 1 s; generating (0.5·10 + 0.2·5) / 15
    assert rate_window(records, 4) == RateWindow(2, 2, 2, 3000, 15.0, 7.0, 25.0, 0.4)
    assert rate_window(records, 1) == RateWindow(1, 2, 2, 1000, 5.0, 2.0, 9.0, 0.2)


def test_no_rate_window_without_a_step_after_step_0_or_without_the_saturated_time():
    assert rate_window([record(0, 50.0)], 4) is None
    assert rate_window([record(0, 50.0), record(1, 60.0, saturated_s=None)], 4) is None
    assert rate_window([record(0, 50.0), record(1, 60.0, twt_s=20.0)], 4) is None  # no work


# --------------------------------------------------------------------------- the model


def test_a_trainer_bound_window_predicts_more_trainer_ranks():
    # trainer: 24 ranks busy at 1000 tok/s each bound the 24k seen; rollout saturated a fifth
    w = window(supply=15_000.0, demand=1000.0, goodput=24_000.0)
    assert predicted_goodput(8, 32, w, margin=0.05) == 24_000.0
    assert predicted_goodput(4, 32, w, margin=0.05) == 28_000.0  # min(60k, 28k)
    assert planned_rollout_ranks(8, 32, w, lo=1, hi=31, max_moves=4, margin=0.05) == 4
    # unbounded moves: the best split is 2 (min(30k, 30k))
    assert planned_rollout_ranks(8, 32, w, lo=1, hi=31, max_moves=32, margin=0.05) == 2
    assert planned_rollout_ranks(8, 32, w, lo=6, hi=31, max_moves=32, margin=0.05) == 6


def test_a_rollout_bound_window_predicts_more_rollout_ranks():
    w = window(supply=1000.0, demand=2000.0, goodput=8000.0)  # rollout saturated throughout
    assert planned_rollout_ranks(8, 32, w, lo=1, hi=31, max_moves=4, margin=0.05) == 12


def test_a_window_neither_side_bound_by_environment_latency_predicts_no_move():
    # the tasks waited for their tools throughout; rollout never saturated, the trainer busy
    # an eighth: no split changes the latency that bounds it
    w = window(supply=math.inf, demand=8000.0, goodput=24_000.0)
    assert w.latency_bound(4, 0.05) == w.latency_bound(12, 0.05) == 24_000.0
    assert predicted_goodput(4, 32, w, margin=0.05) == 24_000.0
    assert planned_rollout_ranks(8, 32, w, lo=1, hi=31, max_moves=4, margin=0.05) == 8


def test_a_latency_bound_window_that_generates_half_the_time_predicts_more_rollout():
    # L(n) = 24k / (0.5 + 0.5·8/n): 28.8k at 12 ranks, 20k at 6 (the trainer has 160k to spare)
    w = window(supply=math.inf, demand=8000.0, goodput=24_000.0, generating=0.5)
    assert predicted_goodput(12, 32, w, margin=0.05) == pytest.approx(28_800.0)
    assert predicted_goodput(6, 32, w, margin=0.05) == pytest.approx(24_000.0 / (0.5 + 4 / 6))
    assert planned_rollout_ranks(8, 32, w, lo=1, hi=31, max_moves=4, margin=0.05) == 12


def test_a_predicted_gain_within_the_margin_moves_nothing():
    w = window(supply=15_000.0, demand=1000.0, goodput=24_000.0)  # 7 ranks: 25k, +4.2%
    assert planned_rollout_ranks(8, 32, w, lo=1, hi=31, max_moves=1, margin=0.05) == 8
    assert planned_rollout_ranks(8, 32, w, lo=1, hi=31, max_moves=1, margin=0.04) == 7


# --------------------------------------------------------------------------- the plans


def predictive_input(layout: tuple[Role, ...], *, step: int, goodput: tuple[float, ...],
                     rates: RateWindow | None) -> ERSInput:
    return ERSInput(step, False, ReadinessSignals(0, 10.0, 1.0, 64, 6400), 60.0, layout,
                    Placement.COLOCATED, Ra2pTimings(1.0, 1.0, 2.0, 0.5), 16,
                    BatchBounds(min=32, ideal=64), goodput=goodput,
                    rates=rates)


def test_a_predicted_move_takes_the_highest_rollout_ranks_and_goes_on_trial():
    layout = (R,) * 8 + (A,) * 24
    w = window(supply=15_000.0, demand=1000.0, goodput=24_000.0)
    policy = ERSPolicy(PREDICTIVE, RA2PConfig())
    first = policy.plan(predictive_input(layout, step=3, goodput=(5.0, 10.0, 10.0), rates=w))
    assert first == ScalingPlan((), Placement.COLOCATED, 64, PlanReason.BALANCED)  # to be confirmed
    assert policy.state == ERSState(recent=(Direction.TO_TRAINER,))
    got = policy.plan(predictive_input(layout, step=4, goodput=(5.0, 10.0, 10.0, 10.0),
                                       rates=w))
    moves = tuple(RoleChange(r, R, A) for r in (7, 6, 5, 4))
    assert got == ScalingPlan(moves, Placement.COLOCATED, 64, PREDICTED)  # a full batch ready
    assert policy.state.trial == Trial(Direction.TO_TRAINER, moves, Placement.COLOCATED, 4, 10.0)


def test_a_predicted_move_to_rollout_lends_the_highest_actor_ranks():
    layout = (R,) * 8 + (A,) * 24
    w = window(supply=math.inf, demand=8000.0, goodput=24_000.0, generating=0.5)
    policy = ERSPolicy(replace(PREDICTIVE, confirm_steps=1), RA2PConfig())
    got = policy.plan(predictive_input(layout, step=3, goodput=(5.0, 10.0, 10.0), rates=w))
    moves = tuple(RoleChange(r, A, R) for r in (31, 30, 29, 28))
    assert got == ScalingPlan(moves, Placement.COLOCATED, 64, PREDICTED)
    assert policy.state.trial == Trial(Direction.TO_ROLLOUT, moves, Placement.COLOCATED, 3, 10.0)


def test_a_predicted_move_that_trains_slower_is_reverted():
    layout = (R,) * 4 + (A,) * 28  # before the move
    policy = ERSPolicy(PREDICTIVE, RA2PConfig())
    moves = tuple(RoleChange(r, R, A) for r in (3, 2))
    policy.state = ERSState(Direction.TO_TRAINER,
                            trial=Trial(Direction.TO_TRAINER, moves, Placement.COLOCATED, 3, 10.0))
    trained = (*layout[:2], A, A, *layout[4:])  # steps 3 and 4 trained slower on this layout
    got = policy.plan(predictive_input(trained, step=5, goodput=(5.0, 10.0, 10.0, 8.0, 9.0),
                                       rates=None))
    assert got.reason is PlanReason.REVERT
    assert got.changes == tuple(RoleChange(r, A, R) for r in (3, 2))


def test_without_measured_rates_the_predictive_planner_moves_nothing():
    policy = ERSPolicy(PREDICTIVE, RA2PConfig())
    layout = (R,) * 8 + (A,) * 24
    got = policy.plan(predictive_input(layout, step=3, goodput=(5.0, 10.0, 10.0), rates=None))
    assert got == ScalingPlan((), Placement.COLOCATED, 64, PlanReason.BALANCED)


def test_an_unknown_planner_is_a_config_error():
    with pytest.raises(ConfigError, match="planner: expected one of rules, predictive"):
        ERSConfig(planner="mpc")
