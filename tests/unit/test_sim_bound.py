"""The goodput bound (tiderl/sim/bound.py): each part is the hardware model's own cost of that
work at its best, the whole is the algebra of docs/simulator.md, and no simulated system beats
it."""

from __future__ import annotations

import pytest

from tiderl.core.job import JobShape
from tiderl.core.types import MicroBatch, SeqRef
from tiderl.sim.bound import (
    _prefill_compute_s,
    best_decode_batch,
    goodput_bound,
    rollout_gpu_s,
    scenario_bound,
    shortest_wall_s,
    train_gpu_s,
)
from tiderl.sim.cluster import simulate
from tiderl.sim.config import SimConfig
from tiderl.sim.hardware import GPUS, MODELS, CostModel
from tiderl.sim.runner import against_splits
from tiderl.sim.scenario import SYSTEMS, SimScenario
from tiderl.sim.trainer import actor_times, ref_time
from tiderl.sim.workload import TaskPlan, TurnPlan

COST = CostModel(MODELS["qwen2.5-7b"], GPUS["h100-sxm"])
K = COST.model.kv_bytes_per_token / COST.gpu.kv_bw  # a decode step's time per context token


def plan(prompt: int, *turns: tuple[int, int, float], reset_s: float = 0.0) -> TaskPlan:
    """turns: (tokens added to the context, tokens generated, environment latency after)."""
    return TaskPlan("g0.0", "g0", "webshop", False, prompt, reset_s,
                    tuple(TurnPlan(add, out, env) for add, out, env in turns), 1.0)


def test_a_decode_step_is_its_fixed_part_plus_the_contexts_it_reads():
    for batch, context in [(1, 100), (64, 2000), (264, 5000)]:
        assert COST.decode_fixed_s(batch) + batch * context * K == pytest.approx(
            COST.decode_step_s(batch, batch * context))


def test_a_one_turn_rollout_costs_its_prompt_share_and_each_token_at_its_context():
    one = plan(1000, (0, 10, 0.0))
    batch = 100
    prefill = _prefill_compute_s(COST, 1000, 0) / 4  # the group's prompt, once for 4 tasks
    decode = 10 * COST.decode_fixed_s(batch) / batch + sum(1000 + i for i in range(10)) * K
    assert rollout_gpu_s(COST, one, batch, group_size=4) == pytest.approx(prefill + decode)
    # the prefill's compute-bound cost is below any real prefill pass of the same tokens
    assert _prefill_compute_s(COST, 1000, 0) < COST.prefill_s([(1000, 0)])


def test_a_second_turn_prefills_only_what_was_added_over_the_context_before_it():
    two = plan(1000, (0, 10, 0.0), (50, 5, 0.0))
    first = plan(1000, (0, 10, 0.0))
    extra = rollout_gpu_s(COST, two, 64, 1) - rollout_gpu_s(COST, first, 64, 1)
    decode = 5 * COST.decode_fixed_s(64) / 64 + sum(1060 + i for i in range(5)) * K
    assert extra == pytest.approx(_prefill_compute_s(COST, 50, 1010) + decode)


def test_the_trainer_s_passes_are_the_trainer_s_own_costs():
    three = plan(1000, (0, 10, 0.0), (50, 5, 0.0))
    (n,) = three.segment_tokens
    mb = MicroBatch(0, (SeqRef("g0.0", n),), 0.0)
    forward, backward = actor_times(COST, mb, 1)
    assert train_gpu_s(COST, three) == pytest.approx(ref_time(COST, mb, 1) + forward + backward)


def test_the_shortest_trajectory_is_its_environment_its_prefills_and_decode_at_batch_one():
    waits = plan(1000, (0, 3, 2.0), (50, 2, 0.5), reset_s=1.0)
    decode = sum(COST.decode_step_s(1, c) for c in (1000, 1001, 1002, 1063, 1064))
    prefill = COST.prefill_s([(1000, 0)]) + COST.prefill_s([(0, 1000)]) \
        + COST.prefill_s([(50, 1003)])
    assert shortest_wall_s(COST, waits) == pytest.approx(3.5 + prefill + decode)


def test_the_decode_batch_is_what_the_kv_holds_at_the_mean_decoded_context():
    plans = [plan(1000, (0, 10, 0.0)), plan(3000, (0, 30, 0.0))]
    mean = (10 * 1000 + 45 + 30 * 3000 + 435) / 40
    assert best_decode_batch(COST, plans) == int(COST.kv_capacity_tokens() // mean)


def test_the_bound_is_the_smaller_of_the_device_and_the_staleness_limits():
    group = (plan(1000, (0, 100, 1.0)), plan(1000, (0, 200, 3.0)))
    evaluation = (plan(500, (0, 50, 0.0)),)
    bound = goodput_bound(COST, [[group]], [evaluation], num_gpus=8, max_staleness=1)
    batch = best_decode_batch(COST, [*group, *evaluation])
    work = (sum(rollout_gpu_s(COST, p, batch, 2) for p in group)
            + rollout_gpu_s(COST, evaluation[0], batch, 1)
            + sum(train_gpu_s(COST, p) for p in group))
    assert bound.trained_tokens == 1100 + 1200
    assert bound.device_tok_s == pytest.approx(8 * 2300 / work)
    wall = (shortest_wall_s(COST, group[0]) + shortest_wall_s(COST, group[1])) / 2
    assert bound.staleness_tok_s == pytest.approx(2 * 2 * 1150 / wall)
    assert bound.tok_s == min(bound.device_tok_s, bound.staleness_tok_s)
    assert bound.limit == ("devices" if bound.device_tok_s <= bound.staleness_tok_s
                           else "staleness")
    # slow environments and no staleness: the window binds
    slow = (plan(1000, (0, 100, 60.0)), plan(1000, (0, 200, 60.0)))
    assert goodput_bound(COST, [[slow]], [], 8, 0).limit == "staleness"


@pytest.mark.parametrize("env_s", [0.0, 20.0])
def test_no_simulated_system_beats_the_bound(env_s):
    scenario = SimScenario(
        sim=SimConfig(workload="webshop+alfworld", gpus=4, rollout_ratio=0.5, seed=3,
                      env_step_median_s=env_s),
        job=JobShape(steps=4, group_size=4, batch_groups=4, batch_min_groups=2))
    bound = scenario_bound(scenario)
    for spec in SYSTEMS.values():
        result = simulate(spec, scenario)
        assert 0 < result.goodput_tok_s <= bound.tok_s, (spec.label, bound.as_dict())


def test_tiderl_against_fixed_splits():
    fixed = {0.25: 60.0, 0.375: 80.0, 0.5: 70.0, 0.625: 40.0}
    assert against_splits(90.0, fixed) == {"best_fixed_split": 0.375, "tiderl_over_best_fixed":
                                           1.125, "tiderl_over_median_fixed": 1.385,
                                           "tiderl_rank": 1}
    assert against_splits(65.0, fixed)["tiderl_rank"] == 3  # behind 0.375 and 0.5
