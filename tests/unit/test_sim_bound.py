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


def test_the_separate_limits_are_the_device_and_the_staleness_algebra():
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
    trained = sum(train_gpu_s(COST, p) for p in group) / 8  # the batch's passes on 8 GPUs
    assert bound.staleness_tok_s == pytest.approx(2 * 2 * 1150 / (wall + trained))
    assert bound.tok_s <= min(bound.device_tok_s, bound.staleness_tok_s) * (1 + 1e-12)
    # slow environments and no staleness: the window binds at batch 1, the coupled bound is it
    slow = goodput_bound(COST, [[(plan(1000, (0, 100, 60.0)), plan(1000, (0, 200, 60.0)))]],
                         [], 8, 0)
    assert (slow.limit, slow.coupled_batch) == ("staleness", 1.0)
    assert slow.tok_s == pytest.approx(slow.staleness_tok_s)


def test_the_coupled_bound_is_where_device_and_window_times_cross():
    """No environment, one GPU, a window of 4 trajectories of 400 tokens each (each holding its
    place until its batch is trained): at the KV's batch the window is too narrow to keep a GPU
    that busy, at batch 1 the GPU is too slow; the bound is where both give the same least run
    time, computed here from the hardware model's costs."""
    batches = [[tuple(plan(200, (0, 400, 0.0)) for _ in range(4))] for _ in range(3)]
    bound = goodput_bound(COST, batches, [], num_gpus=1, max_staleness=0)
    assert bound.limit == "coupled" and 1 < bound.coupled_batch < bound.decode_batch
    beta, plans = bound.coupled_batch, [p for b in batches for g in b for p in g]
    device_s = sum(rollout_gpu_s(COST, p, beta, 4) + train_gpu_s(COST, p) for p in plans)
    batch_s = sum(train_gpu_s(COST, p) for p in plans[:4])  # a batch's passes, on the one GPU
    window_s = sum(shortest_wall_s(COST, p, beta) + batch_s for p in plans) / 4
    assert device_s == pytest.approx(window_s, rel=1e-9)
    assert bound.tok_s == pytest.approx(bound.trained_tokens / device_s, rel=1e-9)
    assert bound.tok_s < min(bound.device_tok_s, bound.staleness_tok_s)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_a_decode_steps_fixed_part_and_its_share_per_token_are_convex_in_the_batch(model, gpu):
    """Jensen's premise: any mix of decode batches costs at least its mean batch would."""
    cost = CostModel(MODELS[model], GPUS[gpu])
    for f in (cost.decode_fixed_s, lambda b: cost.decode_fixed_s(b) / b):
        values = [f(b) for b in range(1, 1025)]
        assert all(values[k - 1] + values[k + 1] >= 2 * values[k] * (1 - 1e-12)
                   for k in range(1, len(values) - 1))


@pytest.mark.parametrize(("env_s", "gpus"), [(0.0, 4), (0.0, 8), (2.0, 4), (20.0, 4)])
def test_no_simulated_system_beats_the_bound(env_s, gpus):
    """Every limit, the coupled one included (it binds at 0 s and at 2 s on 4 GPUs)."""
    scenario = SimScenario(
        sim=SimConfig(workload="webshop+alfworld", gpus=gpus, rollout_ratio=0.5, seed=3,
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
