"""The simulated cluster end to end on small scenarios: conservation, staleness, determinism,
identical task streams across systems, and the core policy objects it drives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tiderl.core.ctb import CTBPolicy, RequestLevelPolicy
from tiderl.core.ers import ERSPolicy
from tiderl.core.job import JobShape
from tiderl.core.readiness import ReadinessTracker
from tiderl.core.system import StepMode, System, SystemSpec
from tiderl.core.task_book import TaskBook
from tiderl.sim.cluster import Cluster, simulate, simulate_rollout_step, simulate_trainer_step
from tiderl.sim.config import SimConfig
from tiderl.sim.scenario import SYSTEMS, SimScenario

SMALL = SimScenario(
    sim=SimConfig(workload="webshop+alfworld", gpus=4, rollout_ratio=0.5, seed=3),
    job=JobShape(steps=4, group_size=4, batch_groups=4, batch_min_groups=2))
ALL = [*SYSTEMS.values(), SystemSpec(System.TIDERL, ctb=False),
       SystemSpec(System.TIDERL, ra2p=False), SystemSpec(System.TIDERL, ers=False)]


@pytest.fixture(scope="module")
def results():
    return {spec.label: simulate(spec, SMALL) for spec in ALL}


def test_every_system_trains_every_step(results):
    for label, result in results.items():
        assert len(result.steps) == SMALL.job.steps, label
        assert all(s.trained_samples > 0 for s in result.steps), label
        assert result.wall_s == result.steps[-1].end_s > 0
        assert result.goodput_tok_s == pytest.approx(result.trained_tokens / result.wall_s)


def test_tokens_are_conserved_exactly(results):
    for label, r in results.items():
        assert r.generated_tokens == r.trained_tokens + r.discarded_tokens + r.in_flight_tokens, \
            label
        assert r.trained_tokens == sum(s.trained_tokens for s in r.steps), label


def test_trained_data_is_never_staler_than_the_bound(results):
    for label, r in results.items():
        bound = 0 if label == "sync" else SMALL.job.max_staleness
        assert max(s.staleness_max for s in r.steps) <= bound, label


def test_same_seed_same_result():
    first, second = simulate(SYSTEMS["tiderl"], SMALL), simulate(SYSTEMS["tiderl"], SMALL)
    assert first.steps == second.steps
    assert (first.wall_s, first.kv_hit_rate, first.rwt_s) == (
        second.wall_s, second.kv_hit_rate, second.rwt_s)


def test_different_seed_different_stream():
    a = Cluster(SYSTEMS["async"], SMALL)
    b = Cluster(SYSTEMS["async"], SMALL.with_sim(seed=4))
    a.run(), b.run()
    assert a.fed_groups[0] != b.fed_groups[0]


def test_systems_see_identical_task_streams():
    streams = []
    for spec in SYSTEMS.values():
        cluster = Cluster(spec, SMALL)
        cluster.run()
        streams.append(cluster.fed_groups)
    shortest = min(len(s) for s in streams)
    assert shortest >= SMALL.job.steps * SMALL.job.batch_groups
    assert all(s[:shortest] == streams[0][:shortest] for s in streams)


def test_policies_are_the_core_objects(results):
    tiderl = results["tiderl"].policies
    assert type(tiderl["ctb"]) is CTBPolicy
    assert type(tiderl["ers"]) is ERSPolicy
    assert type(tiderl["book"]) is TaskBook
    assert type(tiderl["tracker"]) is ReadinessTracker
    for label in ("sync", "async", "stream", "tiderl-no_ctb"):
        assert type(results[label].policies["request"]) is RequestLevelPolicy, label
    assert "ers" not in results["tiderl-no_ers"].policies


def test_systems_use_their_trainers(results):
    assert {s.step_mode for s in results["sync"].steps} == {StepMode.BATCH}
    assert {s.step_mode for s in results["async"].steps} == {StepMode.BATCH}
    assert {s.step_mode for s in results["stream"].steps} == {StepMode.VSO}
    assert {s.step_mode for s in results["tiderl-no_ra2p"].steps} == {StepMode.VSO}
    tiderl_modes = {s.step_mode for s in results["tiderl"].steps}
    assert tiderl_modes <= {StepMode.COLOCATED, StepMode.DECOUPLED}
    sync = results["sync"]
    assert all(s.num_rollout == s.num_trainer == SMALL.sim.gpus for s in sync.steps)
    fixed = results["tiderl-no_ers"]
    assert all(s.num_rollout == 2 for s in fixed.steps)
    # without ERS nothing makes a Ref rank: RA2P has no decoupled layout to choose
    assert {s.step_mode for s in fixed.steps} == {StepMode.COLOCATED}


def test_every_step_reports_its_kv_retention(results):
    """Every step's turns include second turns at one version (the by-hand count is in
    test_sim_engine)."""
    for label in ("tiderl", "async", "stream"):
        retention = [s.kv_retention for s in results[label].steps]
        assert all(r is not None and 0.9 <= r <= 1.0 for r in retention), (label, retention)


def test_rollout_step_ctb_and_request_level():
    scenario = SMALL.with_sim(workload="webshop")
    ctb = simulate_rollout_step(scenario, 32, ctb=True, concurrency=None)
    request = simulate_rollout_step(scenario, 32, ctb=False, concurrency=8)
    for result in (ctb, request):
        assert result.wall_s > 0 and result.gen_tok_s > 0 and 0 < result.kv_hit_rate < 1
    assert request.wall_s > ctb.wall_s  # 8 requests at a time vs all of them


def test_trainer_step_modes():
    ready = [0.0] * 8
    times = {mode: simulate_trainer_step(SMALL, mode, ready, 8192, 4)
             for mode in ("colocated", "decoupled", "vs", "vso")}
    assert times["colocated"] < times["vso"] and times["vs"] < times["vso"]
    assert times["decoupled"] > 0
    with pytest.raises(ValueError):
        simulate_trainer_step(SMALL, "bogus", ready, 8192, 4)


def test_evaluation_phases_roll_out_but_are_not_trained():
    scenario = SMALL.with_job(eval_every=2, eval_groups=2)
    cluster = Cluster(SYSTEMS["tiderl"], scenario)
    result = cluster.run()
    assert cluster.pool.eval_tokens > 0
    assert result.generated_tokens == (result.trained_tokens + result.discarded_tokens
                                       + result.in_flight_tokens)


def test_ers_role_moves_keep_tokens_conserved():
    """8 GPUs: deficits move a trainer rank to rollout and back, so rollout ranks close with
    tasks on them (they resume elsewhere with a fresh prefill)."""
    scenario = replace(SMALL.with_sim(gpus=8, rollout_ratio=0.375)
                       .with_job(steps=8, batch_groups=8, batch_min_groups=4),
                       ers=replace(SMALL.ers, confirm_steps=1))
    result = simulate(SYSTEMS["tiderl"], scenario)
    layouts = {(s.num_rollout, s.num_trainer) for s in result.steps}
    assert len(layouts) > 1
    assert result.generated_tokens == (result.trained_tokens + result.discarded_tokens
                                       + result.in_flight_tokens)
