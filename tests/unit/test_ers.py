import pytest

from tiderl.core.config import ConfigError
from tiderl.core.ers import (
    Direction,
    ERSConfig,
    ERSInput,
    ERSPolicy,
    ERSState,
    classify,
    elastic_batch_size,
)
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

T = Ra2pTimings(t_ref=1.0, t_act_f=1.0, t_act_b=2.0, t_swap=0.5)  # actor busy time 3.0
NUM_MB = 16
R, F, A = Role.ROLLOUT, Role.REF, Role.ACTOR  # F: reF
ROLES = {"R": R, "F": F, "A": A, "I": Role.IDLE}
GEN = PlanReason.GENERATION_DEFICIT
CONS = PlanReason.CONSUMPTION_DEFICIT
COL, DEC = Mode.COLOCATED, Mode.DECOUPLED


def roles(layout: str) -> tuple[Role, ...]:
    return tuple(ROLES[c] for c in layout)


def make_input(
    layout: str,
    mode: Mode = COL,
    *,
    step: int = 5,
    is_eval: bool = False,
    ras: int = 0,
    tprm: float | None = None,
    hol: float = 0.0,
    volume: int = 0,
) -> ERSInput:
    signals = ReadinessSignals(ras, tprm, hol, volume, volume * 100)
    return ERSInput(step, is_eval, signals, 60.0, roles(layout), mode, T, NUM_MB)


def starved(layout: str, mode: Mode = COL, **kw) -> ERSInput:
    """Generation deficit: little ready, nothing at the start, no post-start gap seen."""
    return make_input(layout, mode, ras=0, tprm=None, hol=0.0, volume=16, **kw)


def backlogged(layout: str, mode: Mode = COL, **kw) -> ERSInput:
    """Consumption deficit: a full batch ready and its head older than tau·T_step (60 s)."""
    return make_input(layout, mode, ras=0, tprm=None, hol=100.0, volume=64, **kw)


def plan(*changes: tuple[int, Role, Role], mode: Mode, batch: int, reason: PlanReason):
    return ScalingPlan(tuple(RoleChange(*c) for c in changes), mode, batch, reason)


def apply(layout: tuple[Role, ...], result: ScalingPlan) -> tuple[Role, ...]:
    new = list(layout)
    for change in result.changes:
        assert new[change.rank] is change.src
        new[change.rank] = change.dst
    return tuple(new)


# --------------------------------------------------------------------------- phases


def test_cold_start_maximises_rollout():
    result = ERSPolicy().plan(make_input("RRRRFAAA", DEC, step=0, volume=0))
    assert result == plan(
        (4, F, R), (7, A, R), (6, A, R), mode=COL, batch=64, reason=PlanReason.COLD_START
    )


def test_evaluation_maximises_rollout_down_to_the_trainer_minimum():
    policy = ERSPolicy(ERSConfig(min_trainer_ranks=2))
    result = policy.plan(make_input("RRRRAAAA", is_eval=True, volume=64))
    assert result == plan((7, A, R), (6, A, R), mode=COL, batch=64, reason=PlanReason.EVALUATION)
    # at the minimum a Ref rank cannot leave; colocated mode turns it into an actor
    result = policy.plan(make_input("RRAF", DEC, is_eval=True, volume=64))
    assert result == plan((3, F, A), mode=COL, batch=64, reason=PlanReason.EVALUATION)


def test_idle_ranks_never_move():
    result = ERSPolicy().plan(make_input("RIAIA", step=0))
    assert result == plan((4, A, R), mode=COL, batch=64, reason=PlanReason.COLD_START)


# --------------------------------------------------------------------------- deficits


def test_generation_deficit_releases_ref_ranks_then_actors():
    policy = ERSPolicy()
    first = policy.plan(starved("RRRRFAAA", DEC))
    assert first == plan((4, F, R), mode=COL, batch=64, reason=GEN)
    second = policy.plan(starved("RRRRRAAA", COL))
    assert second == plan((7, A, R), mode=COL, batch=64, reason=GEN)


def test_consumption_deficit_by_hol_provisions_a_ref_rank_then_actors():
    policy = ERSPolicy()
    first = policy.plan(backlogged("RRRRAA"))
    assert first == plan((3, R, F), mode=DEC, batch=64, reason=CONS)
    second = policy.plan(backlogged("RRRFAA", DEC))
    assert second == plan((2, R, A), mode=DEC, batch=64, reason=CONS)


def test_consumption_deficit_by_ras_at_the_break_even():
    assert break_even_ras(NUM_MB, 10.0, T, 2, 8) == 11  # long TPRM: decoupled needs a backlog
    at_break_even = make_input("RRRRAA", ras=11, tprm=10.0, hol=1.0, volume=40)
    assert ERSPolicy().plan(at_break_even) == plan((3, R, F), mode=DEC, batch=40, reason=CONS)
    below = make_input("RRRRAA", ras=10, tprm=10.0, hol=1.0, volume=40)
    assert ERSPolicy().plan(below) == plan((5, A, R), mode=COL, batch=64, reason=GEN)


def test_short_tprm_asks_for_decoupled_and_more_trainer_ranks():
    # TPRM 2 s < actor time 3 s: micro-batches arrive faster than the trainer consumes them, so
    # even with a young buffer head (HoL 1 s) a Ref rank comes first, then actors.
    assert break_even_ras(NUM_MB, 2.0, T, 2, 8) == 0
    flowing = make_input("RRRRAA", ras=0, tprm=2.0, hol=1.0, volume=16)
    assert ERSPolicy().plan(flowing) == plan((3, R, F), mode=DEC, batch=32, reason=CONS)
    flowing = make_input("RRRFAA", DEC, ras=0, tprm=2.0, hol=1.0, volume=16)
    assert ERSPolicy().plan(flowing) == plan((2, R, A), mode=DEC, batch=32, reason=CONS)


def test_ras_at_the_break_even_without_a_backlog_only_provisions_the_ref_rank():
    # TPRM 3.5 s > actor time 3 s and HoL 1 s: no backlog; RAS 0 >= break-even 0 asks for the
    # decoupled mode only, so a Ref rank is provisioned once and nothing more moves.
    assert break_even_ras(NUM_MB, 3.5, T, 2, 8) == 0
    paced = make_input("RRRRAA", ras=0, tprm=3.5, hol=1.0, volume=16)
    assert ERSPolicy().plan(paced) == plan((3, R, F), mode=DEC, batch=32, reason=CONS)
    paced = make_input("RRRFAA", DEC, ras=0, tprm=3.5, hol=1.0, volume=16)
    assert ERSPolicy().plan(paced) == plan(mode=DEC, batch=64, reason=CONS)


def test_idle_rollout_is_no_generation_deficit():
    # the same starved buffer, but rollout sat idle half of the last step (throttled): more
    # rollout ranks would not produce more, so nothing moves to rollout
    idle = ERSInput(5, False, ReadinessSignals(0, None, 0.0, 16, 0), 60.0, roles("RRRRFAAA"),
                    DEC, T, NUM_MB, rollout_idle_frac=0.5)
    result = ERSPolicy().plan(idle)
    assert result.reason is not GEN and result.changes == ()
    busy = ERSInput(5, False, ReadinessSignals(0, None, 0.0, 16, 0), 60.0, roles("RRRRFAAA"),
                    DEC, T, NUM_MB, rollout_idle_frac=0.1)
    assert ERSPolicy().plan(busy).reason is GEN


def test_balanced_keeps_everything():
    balanced = make_input("RRRRAA", ras=0, tprm=10.0, hol=1.0, volume=64)
    assert classify(balanced, ERSConfig(), RA2PConfig()) is PlanReason.BALANCED
    assert ERSPolicy().plan(balanced) == plan(mode=COL, batch=64, reason=PlanReason.BALANCED)


def test_scale_up_is_bounded_per_step():
    inp = backlogged("RRRRRAA")
    assert ERSPolicy().plan(inp) == plan((4, R, F), mode=DEC, batch=64, reason=CONS)
    policy = ERSPolicy(ERSConfig(max_scale_up_per_step=2))
    assert policy.plan(inp) == plan((4, R, F), (3, R, A), mode=DEC, batch=64, reason=CONS)


def test_min_ranks_are_respected():
    # no rollout rank to spare: an actor becomes the Ref rank if another actor remains
    assert ERSPolicy().plan(backlogged("RAA")) == plan((2, A, F), mode=DEC, batch=64, reason=CONS)
    assert ERSPolicy().plan(backlogged("RA")) == plan(mode=COL, batch=64, reason=CONS)
    policy = ERSPolicy(ERSConfig(min_rollout_ranks=3))
    assert policy.plan(backlogged("RRRAA")) == plan((4, A, F), mode=DEC, batch=64, reason=CONS)
    # the trainer keeps min_trainer_ranks and at least one actor
    assert ERSPolicy().plan(starved("RRRA")) == plan(mode=COL, batch=64, reason=GEN)
    policy = ERSPolicy(ERSConfig(min_trainer_ranks=2))
    assert policy.plan(starved("RRAA")) == plan(mode=COL, batch=64, reason=GEN)


def test_fixed_colocated_mode_never_creates_ref_ranks():
    policy = ERSPolicy(ra2p=RA2PConfig(mode="colocated"))
    assert policy.plan(backlogged("RRRAA")) == plan((2, R, A), mode=COL, batch=64, reason=CONS)


# --------------------------------------------------------------------------- batch size


def test_elastic_batch_size():
    config = ERSConfig(batch_min=32, batch_ideal=64)
    assert elastic_batch_size(100, config, is_retaining=False) == 64
    assert elastic_batch_size(100, config, is_retaining=True) == 64
    assert elastic_batch_size(10, config, is_retaining=False) == 64  # an empty boundary is normal
    assert elastic_batch_size(40, config, is_retaining=True) == 40
    assert elastic_batch_size(10, config, is_retaining=True) == 32


def test_adaptive_retention_is_the_step_after_a_rollout_scale_down():
    policy = ERSPolicy()
    paced = make_input("RRRFAA", DEC, ras=0, tprm=3.5, hol=1.0, volume=40)  # no moves
    assert policy.plan(paced).batch_size == 64
    scaled = policy.plan(make_input("RRRFAA", DEC, tprm=2.0, hol=100.0, volume=40))  # scale-down
    assert scaled.changes == (RoleChange(2, R, A),)
    assert scaled.batch_size == 40  # fetch what is ready while the smaller rollout refills
    assert policy.plan(paced).batch_size == 64


def test_disabled_ers_is_a_noop():
    policy = ERSPolicy(ERSConfig(enabled=False))
    result = policy.plan(make_input("RRRRFAAA", DEC, step=0, volume=3))
    assert result == plan(mode=DEC, batch=64, reason=PlanReason.BALANCED)
    assert result.is_noop


# --------------------------------------------------------------------------- hysteresis


def run_alternating(config: ERSConfig, num_steps: int = 20) -> list[ScalingPlan]:
    """Generation deficit on even steps, consumption deficit on odd ones; plans applied."""
    policy = ERSPolicy(config)
    layout, mode, plans = roles("RRRRRFAA"), DEC, []
    for step in range(num_steps):
        make = starved if step % 2 == 0 else backlogged
        inp = make("", mode, step=step)
        result = policy.plan(ERSInput(step, False, inp.signals, 60.0, layout, mode, T, NUM_MB))
        layout, mode = apply(layout, result), result.mode
        plans.append(result)
    return plans


def test_alternating_signals_do_not_thrash():
    plans = run_alternating(ERSConfig(cold_start_steps=0, hysteresis_steps=2))
    moves = {step: p.changes for step, p in enumerate(plans) if p.changes}
    # step 0: the Ref rank goes to rollout; step 2: one actor; then the trainer is at its
    # minimum. Every consumption signal is a single opposite step and is held.
    assert moves == {0: (RoleChange(5, F, R),), 2: (RoleChange(7, A, R),)}
    assert [p.reason for p in plans] == [GEN, CONS] * 10
    assert all(p.mode is COL for p in plans)


def test_without_hysteresis_the_same_signals_thrash():
    plans = run_alternating(ERSConfig(cold_start_steps=0, hysteresis_steps=1))
    assert sum(len(p.changes) for p in plans) == 20
    assert plans[1].changes == (RoleChange(5, R, F),)


def test_reversal_after_consecutive_opposite_signals():
    policy = ERSPolicy(ERSConfig(hysteresis_steps=2))
    assert policy.plan(starved("RRRRFAA", DEC)).changes == (RoleChange(4, F, R),)
    assert policy.plan(backlogged("RRRRRAA")).changes == ()
    assert policy.state == ERSState(Direction.TO_ROLLOUT, 1)
    assert policy.plan(backlogged("RRRRRAA")).changes == (RoleChange(4, R, F),)
    assert policy.state == ERSState(Direction.TO_TRAINER, 0)


def test_a_balanced_step_breaks_the_opposite_streak():
    policy = ERSPolicy(ERSConfig(hysteresis_steps=2))
    policy.plan(starved("RRRRFAA", DEC))
    policy.plan(backlogged("RRRRRAA"))
    policy.plan(make_input("RRRRRAA", ras=0, tprm=10.0, hol=1.0, volume=64))  # balanced
    assert policy.plan(backlogged("RRRRRAA")).changes == ()


def test_a_phase_is_undone_at_its_end_and_resets_hysteresis():
    policy = ERSPolicy(ERSConfig(hysteresis_steps=3))
    policy.plan(starved("RRRRFAA", DEC))  # -> RRRRRAA, direction: to rollout
    during = policy.plan(make_input("RRRRRAA", is_eval=True, volume=64))
    assert during.changes == (RoleChange(6, A, R),)  # -> RRRRRAR
    again = policy.plan(make_input("RRRRRAR", is_eval=True, volume=64))  # still evaluating
    assert again.changes == () and again.reason is PlanReason.EVALUATION
    after = policy.plan(backlogged("RRRRRAR"))
    assert after == plan((6, R, A), mode=COL, batch=64, reason=PlanReason.PHASE_END)
    assert policy.state == ERSState()
    # the phase cleared the memory of the move to rollout: the next signal acts at once
    assert policy.plan(backlogged("RRRRRAA")).changes == (RoleChange(4, R, F),)


def test_cold_start_at_launch_is_undone_for_the_next_step():
    policy = ERSPolicy()
    launch = policy.plan(make_input("RRRRFAAA", DEC, step=0, volume=0))
    assert launch.reason is PlanReason.COLD_START
    layout = apply(roles("RRRRFAAA"), launch)
    assert layout == roles("RRRRRARR")
    first = policy.plan(ERSInput(1, False, ReadinessSignals(0, 10.0, 1.0, 64, 0), 60.0, layout,
                                 COL, T, NUM_MB))
    assert first.reason is PlanReason.PHASE_END and first.mode is DEC
    assert apply(layout, first) == roles("RRRRFAAA")


# --------------------------------------------------------------------------- config


def test_batch_min_above_batch_ideal_is_refused():
    with pytest.raises(ConfigError) as error:
        ERSConfig(batch_min=80, batch_ideal=64)
    assert error.value.key == "batch_min"
    assert error.value.message == "expected <= batch_ideal (64), got 80"


@pytest.mark.parametrize(
    "field, value",
    [
        ("batch_min", 0),
        ("tau", 0.0),
        ("max_scale_up_per_step", 0),
        ("hysteresis_steps", 0),
        ("min_rollout_ranks", 0),
        ("min_trainer_ranks", 0),
        ("cold_start_steps", -1),
    ],
)
def test_config_fields_are_validated(field, value):
    with pytest.raises(ConfigError) as error:
        ERSConfig(**{field: value})
    assert error.value.key == field


def test_input_is_validated():
    with pytest.raises(ValueError, match="step_duration_s"):
        ERSInput(0, False, ReadinessSignals(0, None, 0.0, 0), -1.0, (), COL, T, 4)
