"""Where a simulated run's GPU-seconds go (SimResult.device_s): every category is work the run
did or time it idled, nothing is counted twice, and each category moves as the system does."""

from __future__ import annotations

import pytest

from tiderl.core.job import JobShape
from tiderl.sim.cluster import DEVICE_KEYS, simulate
from tiderl.sim.config import SimConfig
from tiderl.sim.scenario import SYSTEMS, SimScenario

SMALL = SimScenario(
    sim=SimConfig(workload="webshop+alfworld", gpus=4, rollout_ratio=0.5, seed=3),
    job=JobShape(steps=4, group_size=4, batch_groups=4, batch_min_groups=2, eval_every=2,
                 eval_groups=2))
# 32 GPUs, 8 groups a step: the systems that roll out ahead discard groups gone stale (no
# straggler carried past the bound)
STALE = SimScenario(job=JobShape(steps=5, group_size=8, batch_groups=8, batch_min_groups=4,
                                  carry_versions=0))


@pytest.fixture(scope="module")
def results():
    return {(name, scenario is STALE): simulate(spec, scenario)
            for scenario in (SMALL, STALE) for name, spec in SYSTEMS.items()}


def test_every_gpu_second_is_counted_once(results):
    for key, result in results.items():
        seconds = result.device_s
        assert list(seconds) == list(DEVICE_KEYS)
        assert sum(seconds.values()) == pytest.approx(result.scenario.sim.gpus * result.wall_s)
        assert min(seconds.values()) >= -1e-6, (key, seconds)  # idle is what is left: never < 0


def test_discarded_rollout_is_spent_exactly_when_groups_are_discarded(results):
    assert any(r.discarded_tokens for r in results.values())
    for key, result in results.items():
        assert (result.discarded_tokens > 0) == (result.device_s["rollout_discarded"] > 0), key


def test_each_category_follows_what_the_system_does(results):
    small = {name: results[(name, False)].device_s for name in SYSTEMS}
    assert small["sync"]["colocate_switch"] > 0 and small["async"]["colocate_switch"] == 0
    assert small["stream"]["swap"] > small["async"]["swap"]  # a swap pair per micro-batch
    assert all(s["rollout_eval"] > 0 and s["ref"] > 0 and s["actor"] > 0 and s["weight_sync"] > 0
               for s in small.values())
    assert small["sync"]["role_switch"] == small["async"]["role_switch"] == 0


def test_the_accounting_is_deterministic():
    spec = SYSTEMS["tiderl"]
    assert simulate(spec, SMALL).device_s == simulate(spec, SMALL).device_s
