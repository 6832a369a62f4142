"""An upper bound on goodput: the trained tokens per second no scheduler can beat on a scenario
(docs/simulator.md, "The bound").

Two limits, each computed on the scenario's own task stream (the groups every system is fed, and
the evaluation groups the job rolls out), and the bound that couples them:

    devices    every GPU-second of the cluster does required work and nothing else:
                   G_dev = N · T / (R + E + A)
               T the trained tokens of the run's batches, R the rollout GPU-seconds of their
               trajectories at each phase's best efficiency, E the evaluation rollouts' (also
               required, never trained), A the Ref and Actor passes' over T. No idle, no stale
               discards, no swaps, switches or weight syncs, no KV recompute.
    staleness  a trajectory cannot be faster than its environment and its own decode, it holds
               its place in the window until its batch is trained (at least the batch's Ref
               and Actor passes on all N GPUs, a_k = A_k / N), and at most (s + 1)·b
               trajectories are started and not yet trained (the staleness window of b tasks
               per step, tiderl.core.task_book); by Little's law
                   G_stale = (s + 1) · b · t̄ / (w̄ + ā)
               t̄ the mean trained tokens, w̄ the mean shortest wall time of a trajectory and ā
               the mean a_k over trajectories.
    coupled    both at once, at the decode batch β the run's trained tokens were decoded at
               (their token-weighted mean): a token costs its rollout GPU fixed(β)/β and its
               trajectory fixed(β) of wall time, so a batch large enough for the devices needs
               many trajectories in flight, which the window caps. fixed(β) and fixed(β)/β are
               convex, so by Jensen any mix of batches does no better than its mean β:
                   G = T / min over β in [1, B] of max(dev(β), stale(β))
               dev falls and stale rises with β: the minimum is where they cross (bisection).
               At β = B it is G_dev, at β = 1 G_stale; it never exceeds either.

The best efficiency of each phase, from :class:`~tiderl.sim.hardware.CostModel`:

- decode: each output token costs its share of a decode step at the largest batch a GPU's KV
  holds with the running requests alone (waiting tasks hold none): B = ⌊N_kv / c̄⌋, c̄ the
  output-weighted mean context; a token at context c costs fixed(B)/B + c·b_kv/BW_kv, where
  fixed(B) is the step's overhead, linear layers, LM head and recurrent state;
- prefill: each context token is prefilled once (the group's shared prompt once per group) at
  the linear layers' compute-bound cost (no per-pass overhead, no weight reads) plus its causal
  attention over the context before it;
- Ref and Actor: each trained sequence's passes as the trainer times them (``ref_fwd_s``,
  ``actor_fwd_s``, ``actor_bwd_s`` at the sequence's length), perfectly balanced.

The shortest wall time of a trajectory is its reset and environment latencies, plus each turn's
prefill alone on a GPU and its decode at batch 1 (at batch β in the coupled bound, each token
reading at least its own context).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from tiderl.sim.cluster import stream_sampler, training_group
from tiderl.sim.costcache import CachedCostModel
from tiderl.sim.hardware import GPUS, MODELS, CostModel
from tiderl.sim.scenario import SimScenario
from tiderl.sim.workload import TaskPlan


@dataclass(frozen=True)
class GoodputBound:
    tok_s: float  # the bound: the coupled limit (<= min(device_tok_s, staleness_tok_s))
    limit: str  # what binds: "devices" (at batch B), "staleness" (at batch 1) or "coupled"
    device_tok_s: float
    staleness_tok_s: float
    decode_batch: int  # B
    coupled_batch: float  # β where the coupled limits cross (B: devices; 1: staleness)
    trained_tokens: int  # T, over the run's batches
    rollout_gpu_s: float  # R
    eval_gpu_s: float  # E
    train_gpu_s: float  # A
    trajectory_s: float  # w̄

    def as_dict(self) -> dict[str, float | int | str]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _turn_context_sum(n: int, context: int) -> float:
    """The sum of the contexts ``n`` tokens decoded from ``context`` are each decoded at."""
    return n * context + n * (n - 1) / 2


def _decoded_context(plan: TaskPlan) -> tuple[int, float]:
    """(output tokens, the sum over them of the context each is decoded at)."""
    tokens, context_sum = 0, 0.0
    for context, turn in zip(plan.turn_contexts, plan.turns, strict=True):
        tokens += turn.action_tokens
        context_sum += _turn_context_sum(turn.action_tokens, context)
    return tokens, context_sum


def best_decode_batch(cost: CostModel, plans: Iterable[TaskPlan]) -> int:
    """B: the running requests one GPU's KV holds at the output-weighted mean context."""
    tokens, context_sum = 0, 0.0
    for plan in plans:
        n, s = _decoded_context(plan)
        tokens, context_sum = tokens + n, context_sum + s
    mean_context = context_sum / tokens if tokens else 1.0
    return max(1, int(cost.kv_capacity_tokens() // max(mean_context, 1.0)))


def _prefill_compute_s(cost: CostModel, new: int, cached: int) -> float:
    """``new`` tokens prefilled over ``cached`` ones at the compute-bound cost (``t_lin``'s
    compute term alone: no per-layer overhead, no weight reads)."""
    if new <= 0:
        return 0.0
    linear = cost.model.num_layers * 2.0 * cost.model.params_layer * new / cost.gpu.gemm_flops
    return linear + cost.attention_flops(new, cached) / cost.gpu.attn_flops


def _prefills(plan: TaskPlan) -> list[tuple[int, int]]:
    """(new, cached) tokens of each turn's prefill, the prompt apart (first)."""
    chunks, length = [(plan.prompt_tokens, 0)], plan.prompt_tokens
    for turn in plan.turns:
        kept = length - turn.pruned_tokens if turn.kept_prefix is None else turn.kept_prefix
        new = length - turn.pruned_tokens - kept + turn.context_add
        chunks.append((new, kept))
        length = kept + new + turn.action_tokens
    return chunks


def _prefill_gpu_s(cost: CostModel, plan: TaskPlan, group_size: int) -> float:
    """The GPU-seconds of ``plan``'s prefills at their best (its share of the group's prompt)."""
    (prompt, _), *turns = _prefills(plan)
    prefill = _prefill_compute_s(cost, prompt, 0) / group_size
    return prefill + sum(_prefill_compute_s(cost, new, cached) for new, cached in turns)


def rollout_gpu_s(cost: CostModel, plan: TaskPlan, batch: float, group_size: int) -> float:
    """The GPU-seconds of ``plan``'s rollout at the best efficiency (its share of the group's
    prompt prefill), its tokens decoded at ``batch``."""
    tokens, context_sum = _decoded_context(plan)
    decode = tokens * cost.decode_fixed_s(batch) / batch + context_sum * cost.kv_read_s_per_token()
    return _prefill_gpu_s(cost, plan, group_size) + decode


def train_gpu_s(cost: CostModel, plan: TaskPlan) -> float:
    """Ref and Actor GPU-seconds over ``plan``'s training sequences."""
    return sum(cost.ref_fwd_s(n, n) + cost.actor_fwd_s(n, n) + cost.actor_bwd_s(n, n)
               for n in plan.segment_tokens)


def _undecoded_wall_s(cost: CostModel, plan: TaskPlan) -> float:
    """The least wall time of ``plan`` outside decode: its environment and each prefill alone."""
    wall = plan.reset_latency_s + sum(turn.env_latency_s for turn in plan.turns)
    return wall + sum(cost.prefill_s([chunk]) for chunk in _prefills(plan))


def shortest_wall_s(cost: CostModel, plan: TaskPlan, batch: float = 1) -> float:
    """The least wall time of ``plan``: its environment, each prefill alone, decode at
    ``batch`` (1: the fastest), each token reading at least its own context."""
    tokens, context_sum = _decoded_context(plan)
    return (_undecoded_wall_s(cost, plan) + tokens * cost.decode_fixed_s(batch)
            + context_sum * cost.kv_read_s_per_token())


def coupled_batch(device_s, stale_s, largest: int, rounds: int = 60) -> float:
    """The β in [1, ``largest``] minimising max(device_s(β), stale_s(β)), the first
    non-increasing and the second non-decreasing: where they cross, else an end."""
    if device_s(1) <= stale_s(1):
        return 1.0
    if device_s(largest) >= stale_s(largest):
        return float(largest)
    lo, hi = 1.0, float(largest)
    for _ in range(rounds):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if device_s(mid) > stale_s(mid) else (lo, mid)
    return hi


def goodput_bound(cost: CostModel, batches: list[list[tuple[TaskPlan, ...]]],
                  eval_groups: list[tuple[TaskPlan, ...]], num_gpus: int,
                  max_staleness: int) -> GoodputBound:
    """The bound for ``batches`` (each step's training groups, in order) and the run's
    ``eval_groups`` on ``num_gpus`` GPUs of ``cost`` (see the module's text)."""
    plans = [plan for batch in batches for group in batch for plan in group]
    evals = [plan for group in eval_groups for plan in group]
    batch = best_decode_batch(cost, plans + evals)
    kv = cost.kv_read_s_per_token()
    decoded = [_decoded_context(p) for p in plans]
    tokens = sum(n for n, _ in decoded)
    context_s = kv * sum(c for _, c in decoded)
    prefill = sum(_prefill_gpu_s(cost, p, len(g)) for b in batches for g in b for p in g)
    evaluation = sum(rollout_gpu_s(cost, p, batch, len(g)) for g in eval_groups for p in g)
    batch_train = [(sum(len(g) for g in b), sum(train_gpu_s(cost, p) for g in b for p in g))
                   for b in batches]  # (trajectories, Ref and Actor GPU-seconds) per batch
    train = sum(seconds for _, seconds in batch_train)
    outside = sum(_undecoded_wall_s(cost, p) for p in plans)  # environments, prefills alone
    # a trajectory holds its window place until its batch is trained, on every GPU at best
    held = sum(n * seconds for n, seconds in batch_train) / num_gpus
    trained = sum(sum(p.segment_tokens) for p in plans)
    in_flight = (max_staleness + 1) * len(plans) / len(batches)  # the window, in trajectories

    def rollout_s(beta: float) -> float:  # the trained trajectories' rollout GPU-seconds
        return prefill + tokens * cost.decode_fixed_s(beta) / beta + context_s

    def device_s(beta: float) -> float:  # the run's least time on the devices, at batch β
        return (rollout_s(beta) + evaluation + train) / num_gpus

    def decode_wall_s(beta: float) -> float:  # the trajectories' wall time decoding at β
        return tokens * cost.decode_fixed_s(beta) + context_s

    def stale_s(beta: float) -> float:  # ... and through the window (Little's law)
        return (outside + held + decode_wall_s(beta)) / in_flight

    beta = coupled_batch(device_s, stale_s, batch)
    device, stale = trained / device_s(batch), trained / stale_s(1)
    coupled = trained / max(device_s(beta), stale_s(beta))
    limit = "devices" if beta >= batch else "staleness" if beta <= 1 else "coupled"
    return GoodputBound(coupled, limit, device, stale, batch, beta, trained, rollout_s(batch),
                        evaluation, train, (outside + decode_wall_s(1)) / len(plans))

def scenario_bound(scenario: SimScenario) -> GoodputBound:
    """The bound on ``scenario``: its training groups of every step (the stream every system is
    fed) and the evaluation groups its job rolls out."""
    sim, job = scenario.sim, scenario.job
    cost = CachedCostModel(MODELS[sim.model], GPUS[sim.gpu])
    batches = [[training_group(sim.workload, sim.seed, job.steps, step * job.batch_groups + i,
                               job.group_size, step, scenario.env_step)
                for i in range(job.batch_groups)] for step in range(job.steps)]
    sampler = stream_sampler(sim.workload, sim.seed, job.steps, scenario.env_step)
    evals = [tuple(sampler.sample_group(f"e{step}.{i}", job.eval_size, step, is_eval=True))
             for step in range(job.steps) if job.eval_every and step % job.eval_every == 0
             for i in range(job.eval_groups)]
    return goodput_bound(cost, batches, evals, sim.gpus, job.max_staleness)
