"""Where a trained task's place in the staleness window goes (SimResult.window): every trained
task is counted once, its environment part is exactly its plan's latencies, a synchronous run's
places are all accounted for, a wait CTB imposes is counted as held, and the places held never
exceed what the window lets in."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tiderl.core.ctb import CTBConfig
from tiderl.core.job import JobShape
from tiderl.sim.cluster import Cluster
from tiderl.sim.config import SimConfig
from tiderl.sim.experiments import window_means
from tiderl.sim.results import WindowSlots
from tiderl.sim.scenario import SYSTEMS, SimScenario

SMALL = SimScenario(
    sim=SimConfig(workload="webshop+alfworld", gpus=4, rollout_ratio=0.5, seed=3),
    job=JobShape(steps=4, group_size=4, batch_groups=4, batch_min_groups=2, eval_every=2,
                 eval_groups=2))
PARTS = ("spread_s", "env_s", "engine_s", "held_s", "sibling_s", "train_s", "boundary_s")


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name, spec in SYSTEMS.items():
        cluster = Cluster(spec, SMALL)
        out[name] = (cluster, cluster.run())
    return out


def test_each_trained_task_is_counted_once_and_no_part_is_negative(runs):
    for name, (_, result) in runs.items():
        window = result.window
        assert window.tasks == sum(r.trained_samples for r in result.steps), name
        means = window.means()
        assert set(means) == {*PARTS, "slot_s"}, name
        assert all(means[p] >= -1e-9 for p in PARTS), (name, means)
        assert means["train_s"] > 0 and means["engine_s"] > 0, (name, means)


def test_a_synchronous_run_holds_every_place_of_its_window(runs):
    """sync admits its batch once the last one left the window: its places are always held,
    so every place-second must be accounted for (evaluation phases aside, which hold none)."""
    result = runs["sync"][1]
    occupancy = window_means({"sync": result})["sync"]["occupancy"]
    assert 0.95 < occupancy <= 1.0


def test_tasks_ready_while_ctb_holds_them_paused_are_counted_as_held():
    """A budget of 2% of the KV: CTB pauses tasks, and those whose environment answered wait
    for a Resume; that wait is `held_s`, the environment's part stays exact."""
    tight = replace(SMALL, ctb=CTBConfig(budget_fraction=0.02))
    cluster = Cluster(SYSTEMS["tiderl"], tight)
    result = cluster.run()
    assert sum(r.ctb_pauses or 0 for r in result.steps) > 0
    means = result.window.means()
    assert means["held_s"] > 0
    assert result.window.tasks == sum(r.trained_samples for r in result.steps)
    assert result.window.env_s == pytest.approx(_env_s(cluster))


def test_the_environment_part_is_exactly_the_trained_tasks_latencies(runs):
    for name, (cluster, result) in runs.items():
        assert result.window.env_s == pytest.approx(_env_s(cluster)), name


def _env_s(cluster: Cluster) -> float:
    """The trained tasks' reset and step latencies, from the plans the cluster was fed."""
    return sum(p.reset_latency_s + sum(t.env_latency_s for t in p.turns)
               for plans in cluster.fed_groups if plans[0].group_id in cluster._trained_groups
               for p in plans)



def test_places_held_stay_within_the_staleness_window(runs):
    """Summed over the run, trained tasks' places are at most the window's size at every
    instant: (max_staleness + 1) x the batch, in tasks (a synchronous system's bound is 0: one
    batch), over the whole run."""
    job = SMALL.job
    for name, (_, result) in runs.items():
        bound = SYSTEMS[name].max_staleness(job.max_staleness)
        places = (bound + 1) * job.batch_groups * job.group_size
        assert result.window_places == places, name
        seconds = result.window.means()["slot_s"] * result.window.tasks
        assert 0 < seconds <= places * result.wall_s, name
        occupancy = window_means({name: result})[name]["occupancy"]
        assert occupancy == pytest.approx(seconds / (places * result.wall_s), abs=1e-3)
    unthrottled = replace(runs["tiderl"][1], window_places=0)
    assert "occupancy" not in window_means({"tiderl": unthrottled})["tiderl"]


def test_slots_add_and_average():
    a = WindowSlots(tasks=2, spread_s=1.0, env_s=2.0, engine_s=3.0, held_s=0.0, sibling_s=1.0,
                    train_s=5.0)
    a.add(WindowSlots(tasks=2, env_s=2.0, engine_s=1.0, train_s=3.0))
    assert a.means() == {"spread_s": 0.25, "env_s": 1.0, "engine_s": 1.0, "held_s": 0.0,
                         "sibling_s": 0.25, "train_s": 2.0, "boundary_s": 0.0, "slot_s": 4.5}
    assert WindowSlots().means()["slot_s"] == 0.0
