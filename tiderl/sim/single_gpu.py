"""Micro-experiments: one GPU rolling out one step (paper Fig. 12/13), one trainer step (Fig. 14).

Both reuse the cluster's parts (RolloutPool under the core's RolloutControl with the CTB or
request-level policy; the trainer executors) on a private event loop, without training, weight
syncs or staleness.
"""

from __future__ import annotations

import math

from tiderl.core.quote import short
from tiderl.core.step_control import RolloutControl, effective_ctb
from tiderl.core.system import StepMode
from tiderl.sim.costcache import CachedCostModel
from tiderl.sim.events import EventLoop
from tiderl.sim.hardware import GPUS, MODELS, CostModel
from tiderl.sim.results import RolloutResult
from tiderl.sim.rollout import RolloutPool, SimGroup, group_of
from tiderl.sim.scenario import SimScenario
from tiderl.sim.trainer import run_trainer_step
from tiderl.sim.workload import WorkloadSampler

TRAINER_MODES = (StepMode.COLOCATED, StepMode.DECOUPLED, StepMode.VS, StepMode.VSO)


def cost_model(scenario: SimScenario) -> CostModel:
    return CachedCostModel(MODELS[scenario.sim.model], GPUS[scenario.sim.gpu])


def simulate_rollout_step(scenario: SimScenario, num_tasks: int, *, ctb: bool,
                          concurrency: int | None,
                          sampler: WorkloadSampler | None = None,
                          cost: CostModel | None = None) -> RolloutResult:
    """One rollout GPU runs ``num_tasks`` tasks (groups of ``scenario.job.group_size``, step 0 of
    the workload) to completion. ``ctb``: CTB admits and pauses by token budget; otherwise every
    task is admitted at once (request level). ``concurrency`` caps the engine's running
    requests (None: no cap). ``sampler``/``cost`` replace the scenario's (tests)."""
    loop = EventLoop()
    cost = cost or cost_model(scenario)
    sampler = sampler or WorkloadSampler(scenario.sim.workload, scenario.sim.seed,
                                         scenario.job.steps, scenario.env_step)
    config = effective_ctb(scenario.ctb, policy="ctb") if ctb else effective_ctb(
        scenario.ctb, policy="request", request_concurrency=max(1, num_tasks))
    ready: list[SimGroup] = []
    rollout = RolloutControl.of(config, budget=config.rank_budget(cost.kv_capacity_tokens()),
                                max_new_tokens=sampler.max_new_tokens(),
                                block_tokens=scenario.kv_block_size)
    pool = RolloutPool(loop, cost, rollout, round_interval_s=scenario.sim.ctb_round_interval_s,
                       block_size=scenario.kv_block_size, max_running=concurrency,
                       on_group_ready=ready.append)
    rollout.add_rank(0, 0.0)
    pool.add_rank(0)
    num_groups = math.ceil(num_tasks / scenario.job.group_size)
    for i in range(num_groups):
        size = min(scenario.job.group_size, num_tasks - i * scenario.job.group_size)
        plans = sampler.sample_group(f"g{i}", size, 0)
        rollout.add_group(group_of(plans), 0.0)
        pool.add_group(plans)
    while len(ready) < num_groups and len(loop):
        loop.run(until=loop.now + 3600.0)
    engine = pool.engines[0]
    wall = max((g.ready_time for g in ready), default=0.0)
    return RolloutResult(wall_s=wall, gen_tok_s=engine.decoded_tokens / wall if wall else 0.0,
                         kv_hit_rate=engine.kv.hit_rate,
                         num_preemptions=engine.kv.num_preemptions,
                         recomputed_tokens=engine.recomputed_tokens)


def simulate_trainer_step(scenario: SimScenario, mode: str | StepMode, ready_times: list[float],
                          mb_tokens: int, num_gpus: int) -> float:
    """Seconds for ``num_gpus`` trainer GPUs to process micro-batches of ``mb_tokens`` tokens
    ready at ``ready_times`` (relative to the step start). ``mode``: "colocated" (RA2P CM),
    "decoupled" (RA2P DM, ``ra2p.num_ref_ranks`` GPUs run Ref), "vs" (vanilla streaming, a
    context switch per alternation), "vso" (vanilla streaming with a PCIe swap per alternation).
    ``mb_tokens`` is a micro-batch's total: it holds ``num_gpus`` equal sequences (one per DP
    rank; at most ``ra2p.tokens_per_rank`` tokens each, more sequences if needed)."""
    if mode not in TRAINER_MODES:
        names = ", ".join(m.value for m in TRAINER_MODES)
        raise ValueError(f"mode must be one of {names}, got {short(mode)}")
    mode = StepMode(mode)
    num_ref = scenario.ra2p.num_ref_ranks if mode is StepMode.DECOUPLED else 0
    if num_ref >= num_gpus:
        raise ValueError(f"decoupled needs more than {num_ref} GPUs, got {num_gpus}")
    seq_tokens = max(1, min(mb_tokens // num_gpus, scenario.ra2p.tokens_per_rank))
    return run_trainer_step(cost_model(scenario), mode, ready_times, mb_tokens, num_gpus,
                            num_ref=num_ref, max_aggregate=scenario.ra2p.max_aggregate,
                            seq_tokens=seq_tokens)
