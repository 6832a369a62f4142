"""The simulator's fidelity to the paper's setup, each pinned on a hand-built case: training
segments of a pruned trajectory, the aggregated dispatch over the union, the baselines' own costs
(sync's colocate switch and blocking evaluation, stream's micro-batches, async's window), the
anchored evaluation, the shifting workload, the environment override and the sweep's grid."""

from __future__ import annotations

import pytest

from tiderl.core.job import JobShape
from tiderl.core.segments import task_of
from tiderl.core.system import SystemSpec
from tiderl.core.types import MicroBatch, SeqRef
from tiderl.sim.cluster import Cluster, scenario_step_config, simulate
from tiderl.sim.config import SimConfig
from tiderl.sim.events import EventLoop
from tiderl.sim.hardware import GPUS, MODELS, CostModel
from tiderl.sim.rollout import SimGroup, SimTask
from tiderl.sim.scenario import SYSTEMS, SimScenario
from tiderl.sim.sweep import SweepGrid, run_sweep
from tiderl.sim.trainer import AggregatingExecutor
from tiderl.sim.workload import TaskPlan, TurnPlan, WorkloadSampler

SMALL = SimScenario(
    sim=SimConfig(workload="webshop+alfworld", gpus=4, rollout_ratio=0.5, seed=3),
    job=JobShape(steps=4, group_size=4, batch_groups=4, batch_min_groups=2))
MODEL = CostModel(MODELS["qwen2.5-7b"], GPUS["h100-sxm"])


def _pruned_plan(task_id: str) -> TaskPlan:
    """Prompt 100; turns add 50 (+10 out), the second and third prune 20 first: 3 segments."""
    turns = (TurnPlan(50, 10, 1.0), TurnPlan(50, 10, 1.0, kept_prefix=100, pruned_tokens=20),
             TurnPlan(50, 10, 1.0, kept_prefix=100, pruned_tokens=20))
    return TaskPlan(task_id, "g0", "osworld", False, 100, 1.0, turns, 1.0)


def test_each_pruning_segment_is_its_own_training_sequence():
    plans = [_pruned_plan("g0.0"), _pruned_plan("g0.1")]
    group = SimGroup("g0", [SimTask(p) for p in plans], False, plans=plans)
    assert plans[0].segment_tokens == (160, 200, 240)
    assert group.sequences == (SeqRef("g0.0#0", 160), SeqRef("g0.0#1", 200),
                               SeqRef("g0.0#2", 240), SeqRef("g0.1#0", 160),
                               SeqRef("g0.1#1", 200), SeqRef("g0.1#2", 240))
    assert group.num_samples == 2
    assert [task_of(s.seq_id) for s in group.sequences] == ["g0.0"] * 3 + ["g0.1"] * 3


def _aggregate(mbs: list[MicroBatch], *, setup_s: float = 0.0) -> float:
    loop, end = EventLoop(), []
    executor = AggregatingExecutor(loop, MODEL, 2, end.append, max_aggregate=len(mbs),
                                   t_swap=0.0, setup_s=setup_s)
    for mb in mbs:
        loop.at(0.0, executor.add, mb)
    loop.at(0.0, lambda _: executor.close())
    loop.run()
    return end[0]


def test_aggregated_micro_batches_are_dealt_over_the_gpus_as_one_union():
    """Two micro-batches of (8000, 1000) tokens on 2 GPUs: apart, each puts 8000 on one GPU
    (16000 on the critical path); as one union every GPU gets 8000 + 1000."""
    mbs = [MicroBatch(i, (SeqRef(f"{i}a", 8000), SeqRef(f"{i}b", 1000))) for i in range(2)]
    per_gpu = sum(f(n, n) for n in (8000, 1000)
                  for f in (MODEL.ref_fwd_s, MODEL.actor_fwd_s, MODEL.actor_bwd_s))
    assert _aggregate(mbs) == pytest.approx(per_gpu)
    assert _aggregate(mbs, setup_s=7.0) == pytest.approx(per_gpu + 7.0)  # paid once


def test_stream_forms_its_own_micro_batches():
    scenario = SMALL.with_sim(stream_tokens_per_rank=1024)
    cost = MODEL
    assert scenario_step_config(SYSTEMS["stream"], scenario, cost).ra2p.tokens_per_rank == 1024
    for name in ("async", "tiderl"):
        config = scenario_step_config(SYSTEMS[name], scenario, cost)
        assert config.ra2p.tokens_per_rank == scenario.ra2p.tokens_per_rank != 1024


def test_sync_pays_its_colocate_switch_each_way_every_step():
    """Every event of a synchronous run is sequential: 4 steps pay 4 rollout->train switches
    and 3 train->rollout switches (the last step's boundary is the end)."""
    walls = [simulate(SYSTEMS["sync"], SMALL.with_sim(colocate_switch_s=c)).wall_s
             for c in (0.0, 10.0)]
    assert walls[1] - walls[0] == pytest.approx(70.0)


def _watched(system: SystemSpec, scenario: SimScenario):
    """A cluster whose eval groups' ready times and weight-version changes are recorded."""
    cluster = Cluster(system, scenario)
    eval_ready, versions = [], []
    on_ready, set_version = cluster.pool.on_group_ready, cluster.pool.set_version

    def ready(group):
        if group.is_eval:
            eval_ready.append((cluster.loop.now, len(group.tasks)))
        on_ready(group)

    def version(v):
        versions.append((v, cluster.loop.now))
        set_version(v)

    cluster.pool.on_group_ready, cluster.pool.set_version = ready, version
    return cluster, eval_ready, versions


def test_sync_trains_only_after_its_evaluation():
    scenario = SMALL.with_job(eval_every=4, eval_groups=6, eval_group_size=2)
    cluster, eval_ready, _ = _watched(SYSTEMS["sync"], scenario)
    result = cluster.run()
    assert [size for _, size in eval_ready] == [2] * 6  # the launch's evaluation
    first = result.steps[0]
    last_eval = max(t for t, _ in eval_ready)
    # the batch pass (one swap pair, Ref and Actor over the batch, the switch) ran after it
    assert first.end_s - last_eval >= scenario.sim.colocate_switch_s + 2 * MODEL.model_swap_s()


def test_evaluation_finishes_before_the_next_weight_sync():
    """80 evaluation tasks at launch, 8 requests per rank: under request-level rollout they
    outlast step 0 and the version-1 sync waits for the last; CTB's evaluation priority ends
    them within step 0."""
    scenario = SMALL.with_sim(request_concurrency=8).with_job(eval_every=4, eval_groups=40,
                                                              eval_group_size=2)
    for name, outlasts_step in (("async", True), ("tiderl", False)):
        cluster, eval_ready, versions = _watched(SYSTEMS[name], scenario)
        result = cluster.run()
        assert [size for _, size in eval_ready] == [2] * 40, name
        first_sync = min(t for v, t in versions if v == 1)
        last_eval = max(t for t, _ in eval_ready)
        assert last_eval <= first_sync, name
        assert (result.steps[0].end_s < last_eval) is outlasts_step, name


def test_april_window_adds_extra_batches_to_async_admission():
    scenario = SMALL.with_sim(async_over_provision=2.0)  # B = 16 tasks, eta = 1
    # the window, (1 + 2) x 16 tasks, is 2 batches of 24
    assert scenario_step_config(SYSTEMS["async"], scenario, MODEL).window_tasks == 24
    assert Cluster(SYSTEMS["async"], scenario).controller.rollout.book.tasks_per_step == 24
    assert Cluster(SYSTEMS["stream"], scenario).controller.rollout.book.tasks_per_step == 16
    assert Cluster(SYSTEMS["async"], SMALL).controller.rollout.book.tasks_per_step == 16


def test_shifting_workload_changes_environment_halfway():
    sampler = WorkloadSampler("shifting", seed=0, total_steps=10)
    envs = [sampler.sample_group(f"g{s}", 2, s)[0].env for s in range(10)]
    assert envs == ["webshop_slowenv"] * 5 + ["longdoc"] * 5
    assert sampler.max_new_tokens() == 256


def test_environment_step_override():
    sampler = WorkloadSampler("webshop+alfworld", 0, 10, env_step_s=(1.0, 0.0))
    assert sampler.specs["webshop"].env_step_s == (1.0, 0.6)
    assert sampler.specs["alfworld"].env_step_s == (1.0, 0.6)
    default = WorkloadSampler("webshop+alfworld", 0, 10)
    assert default.specs["alfworld"].env_step_s == (0.08, 0.6)


def test_sweep_grid_points_and_rows():
    base = SMALL.with_sim(env_step_median_s=1.0, env_step_sigma=1.0)
    grid = SweepGrid(steps=2, env_median_s=(0.2, 1.0), env_sigma=(1.0,), max_staleness=(1, 2),
                     colocate_switch_s=(0.0,))
    points = grid.points(base)
    assert [(p["env_step_median_s"], p["max_staleness"], p["colocate_switch_s"])
            for p in points] == [(0.2, 1, 5.0), (1.0, 1, 5.0), (1.0, 2, 5.0), (1.0, 1, 0.0)]
    result = run_sweep(base, SweepGrid(steps=2, env_median_s=(1.0,), env_sigma=(1.0,),
                                       max_staleness=(), colocate_switch_s=()))
    (row,) = result.rows
    assert row["tiderl_over_async"] == round(row["tiderl_tok_s"] / row["async_tok_s"], 3)
    assert all(row[f"{name}_tok_s"] > 0 for name in ("sync", "async", "stream", "tiderl"))

