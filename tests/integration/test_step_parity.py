"""One trace through both adapters: the simulator's event heap and the runtime coordinator's bus
drive the same step controller to the same commands.

The simulator runs a small TideRL job (a cold start that lends a trainer rank to rollout and
gives it back when batch 0 is ready, before step 0 opens; a stale group dropped; three steps;
once with room in the KV budget, once with a budget so tight that CTB pauses and resumes tasks
all the time). Every event its adapter fed the controller is recorded with what the controller
answered. The same trace is then played to a real :class:`Coordinator` as the bus messages rank
daemons send for it (TurnReport, TaskFinished with the trajectories' tokens, StepDone with the
pass times, RankMetrics with the prefix-cache counters, Acks to the SyncWeights the coordinator
sent) over real ZeroMQ sockets, on a clock that reads the trace's times. The two controllers'
answers must be identical.

Two things are not messages: a weight sync's stall of the rollout engines, which the simulator
reports whole (the embedded engine keeps generating during a sync, so a rank reports none; it is
handed to the runtime's controller as the substrate's report), and the loss and its token count,
which the simulator does not model (compared as absent).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.integration.bus_ranks import Clock, Ranks
from tiderl.core.commands import RecordStep
from tiderl.core.job import JobShape
from tiderl.core.step_control import LayoutLimits
from tiderl.core.system import System, SystemSpec
from tiderl.launch.plan import profile_roles
from tiderl.profile import load_profile
from tiderl.runtime.bus import (
    BusServer,
    RankMetrics,
    StepDone,
    TaskFinished,
    TurnData,
    TurnReport,
)
from tiderl.runtime.coordinator import Coordinator
from tiderl.runtime.run_log import RunLog
from tiderl.runtime.step_config import profile_step_config as runtime_config
from tiderl.sim.cluster import Cluster
from tiderl.sim.cluster import scenario_step_config as sim_config
from tiderl.sim.config import SimConfig
from tiderl.sim.scenario import SimScenario
from tiderl.sim.workload import TaskPlan

CONTROLLER_EVENTS = ("launch", "group_ready", "step_done", "boundary_acked")
ROLLOUT_EVENTS = ("schedule", "turn_started", "turn_done", "task_finished", "stalled")
SCENARIO = SimScenario(
    sim=SimConfig(workload="webshop", model="qwen3-vl-4b", gpus=3, rollout_ratio=0.34, seed=5),
    job=JobShape(steps=3, group_size=2, batch_groups=2, batch_min_groups=1, eval_groups=1))
PROFILE = [  # the same job as a runtime profile (a 4B model's KV capacity on an H100)
    "runtime.num_ranks=3", "runtime.rollout_ranks=1", "job.steps=3", "job.group_size=2",
    "job.max_staleness=1", "runtime.heartbeat_s=1000000", "runtime.checkpoint_every=0",
    "job.batch_min_groups=1", "job.batch_groups=2", "ers.cold_start_steps=1",
    "runtime.cpu_affinity=spread",  # the simulator's GPUs are each a rank's own
    "ra2p.tokens_per_rank=8192",
    "ctb.request_concurrency=256", "engine.kv_cache_tokens=423044", "engine.max_new_tokens=256",
    "job.eval_groups=1",
]
JOBS = {
    "roomy": (SCENARIO, PROFILE),
    "tight": (replace(SCENARIO.with_job(group_size=4),
                      ctb=replace(SCENARIO.ctb, budget_fraction=0.01)),
              [*PROFILE, "job.group_size=4", "job.batch_min_groups=1", "job.batch_groups=2",
               "ctb.budget_fraction=0.01"]),
}


class Recorder:
    """Wraps the controller's event methods (and its rollout half's): every call, in order, with
    its arguments and what it returned; ``extra(name, args)`` adds what the replay needs."""

    def __init__(self, controller, extra=None) -> None:
        self.calls: list[tuple[str, tuple, dict, object, object]] = []
        for target, names in ((controller, CONTROLLER_EVENTS),
                              (controller.rollout, ROLLOUT_EVENTS)):
            for name in names:
                setattr(target, name, self._wrap(name, getattr(target, name), extra))

    def _wrap(self, name, method, extra):
        def recorded(*args, **kwargs):
            info = extra(name, args) if extra is not None else None
            result = method(*args, **kwargs)
            self.calls.append((name, args, kwargs, result, info))
            return result
        return recorded

    def answers(self) -> list[tuple[str, object]]:
        return [(name, _without_loss(result)) for name, _, _, result, _ in self.calls]


def _without_loss(result):
    if not isinstance(result, list):
        return result
    return [replace(c, record=replace(c.record, loss=None, grad_norm=None,
                                      trained_loss_tokens=None))
            if isinstance(c, RecordStep) else c for c in result]


def run_simulation(scenario: SimScenario) -> tuple[Cluster, Recorder]:
    cluster = Cluster(SystemSpec(System.TIDERL), scenario)

    def extra(name, args):
        if name == "task_finished":
            task = cluster.pool.tasks[args[0]]
            return task.plan, task.version
        return None

    recorder = Recorder(cluster.controller, extra)
    cluster.run()
    return cluster, recorder


def finished(rank: int, plan: TaskPlan, version: int) -> TaskFinished:
    """The trajectory a rank sends for ``plan``: its tokens per turn (their ids do not matter)."""
    turns = []
    for k, turn in enumerate(plan.turns):
        context = plan.prompt_tokens + turn.context_add if k == 0 else turn.context_add
        turns.append(TurnData(context_ids=[7] * context, output_ids=[7] * turn.action_tokens,
                              logprobs=[0.0] * turn.action_tokens, version=version))
    return TaskFinished(rank=rank, task_id=plan.task_id, group_id=plan.group_id,
                        reward=plan.reward, turns=turns, num_tokens=plan.total_tokens)


def replay(calls, ranks: Ranks, coordinator: Coordinator, clock: Clock) -> None:
    controller = coordinator.controller
    for name, args, kwargs, _, info in calls:
        clock.now = args[-1] if name != "stalled" else args[0]
        rank = coordinator.router.task_rank.get(args[0], 0) if isinstance(args[0], str) else 0
        if name == "schedule":
            coordinator.schedule_round()
        elif name in ("turn_started", "turn_done"):
            context, output = args[1:3] if name == "turn_done" else (0, 0)
            ranks.send(rank, TurnReport(rank=rank, task_id=args[0], tokens=output,
                                        context_tokens=context, done=False, version=0,
                                        running=name == "turn_started",
                                        reused_tokens=kwargs.get("reused", 0),
                                        reusable_tokens=kwargs.get("reusable", 0)))
        elif name == "task_finished":
            ranks.send(rank, finished(rank, *info))
        elif name == "stalled":
            controller.rollout.stalled(*args)
        elif name == "step_done":
            outcome = args[0]
            ranks.send(0, RankMetrics(rank=0, role="rollout", kv_tokens_used=0,
                                      kv_tokens_capacity=0, prefix_hit_rate=0.0, running=0,
                                      waiting=0, prefix_queries=outcome.kv_queries,
                                      prefix_hits=outcome.kv_hits))
            for report in outcome.reports:
                stats = {k: getattr(report, k) for k in ("wait_s", "t_ref", "t_act_f",
                                                          "t_act_b", "t_swap")
                         if getattr(report, k) is not None}
                ranks.send(report.rank, StepDone(
                    rank=report.rank, step=outcome.step, version=outcome.step + 1,
                    step_mode="", loss=0.0, loss_tokens=0, grad_norm=0.0, seconds=0.0,
                    stats=stats))
        elif name == "boundary_acked":
            ranks.ack(args[0], args[1])
        # launch and group_ready: the coordinator's own (launch, a group's last TaskFinished)


@pytest.mark.parametrize("job", list(JOBS))
def test_the_simulator_and_the_runtime_drive_the_controller_alike(tmp_path, job):
    scenario, overrides = JOBS[job]
    profile = load_profile("local", overrides)
    cluster, sim = run_simulation(scenario)
    assert replace(runtime_config(profile), limits=LayoutLimits()) == sim_config(
        cluster.system, scenario, cluster.cost)  # the same job on both substrates
    names = [name for name, *_ in sim.calls]
    assert names.count("step_done") == 3 and names.count("boundary_acked") >= 6
    decisions = {type(d).__name__ for name, _, _, out, _ in sim.calls if name == "schedule"
                 for d in out}
    # roomy: the cold start's loan comes back when batch 0 is ready, and the tasks the lent
    # rank held resume on the other; tight: CTB pauses and resumes all the time
    assert decisions == ({"Admit", "Pause", "Resume"} if job == "tight" else {"Admit", "Resume"})
    records = cluster.controller.ledger.records
    assert records[0].roles == ("rollout", "actor", "actor")  # step 0 trains on the whole trainer
    assert records[0].ers_reason == "phase_end"

    clock = Clock()
    with BusServer(None) as server:
        coordinator = Coordinator(profile, server, profile_roles(profile),
                                  RunLog(tmp_path, clock), clock)
        runtime = Recorder(coordinator.controller)
        ranks = Ranks(server, coordinator, 3)
        try:
            ranks.hello()
            coordinator.launch()
            replay(sim.calls[1:], ranks, coordinator, clock)
        finally:
            ranks.close()
            coordinator.log.close()
    assert [n for n, _ in runtime.answers()] == names
    for i, (ours, theirs) in enumerate(zip(runtime.answers(), sim.answers(), strict=True)):
        assert ours == theirs, f"call {i} ({names[i]}) differs"
    assert coordinator.controller.ledger.records[-1].trained_tokens_total == records[-1] \
        .trained_tokens_total > 0

