"""The simulator's engine: the event loop, one rollout rank, the rollout pool, trainer executors.

Hand-computed answers use ``FakeCostModel``: a real CostModel with its timing methods replaced
by round constants, so finish times can be worked out on paper.
"""

from __future__ import annotations

import pytest

from tiderl.core.ctb import CTBConfig, RequestLevelPolicy
from tiderl.core.job import JobShape
from tiderl.core.step_control import RolloutControl
from tiderl.core.system import StepMode
from tiderl.core.types import MicroBatch, SeqRef
from tiderl.sim.costcache import CachedCostModel
from tiderl.sim.engine import RolloutEngine, SimRequest
from tiderl.sim.events import EventLoop
from tiderl.sim.hardware import GPUS, MODELS, CostModel
from tiderl.sim.kvcache import SimKVCache
from tiderl.sim.rollout import RolloutPool, group_of
from tiderl.sim.trainer import actor_times, build_executor, ref_time, union
from tiderl.sim.workload import TaskPlan, TurnPlan

DECODE_S = 0.01  # per engine step, whatever the batch
PREFILL_S_PER_TOKEN = 0.001


class FakeCostModel(CostModel):
    """Fake: round constants instead of the roofline model (a decode step takes 10 ms whatever
    the batch, a prefill 1 ms per computed token, 10,000 KV tokens), so that the finish times
    and cache hits of a tiny scenario can be computed by hand. Everything else is real."""

    def __init__(self, capacity_tokens: int = 10_000) -> None:
        super().__init__(MODELS["qwen2.5-7b"], GPUS["h100-sxm"])
        self._capacity = capacity_tokens

    def decode_step_s(self, batch: int, sum_context: int) -> float:
        return DECODE_S if batch > 0 else 0.0

    def prefill_s(self, chunks) -> float:
        return PREFILL_S_PER_TOKEN * sum(new for new, _ in chunks)

    def kv_capacity_tokens(self) -> int:
        return self._capacity


# --------------------------------------------------------------------------- event loop


def test_events_run_in_time_then_scheduling_order():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")  # same time: after "a", scheduled first
    loop.run()
    assert seen == ["a", "b", "c"] and loop.now == 2.0 and loop.num_events == 3


def test_handlers_may_return_events_and_run_stops_at_until():
    loop, seen = EventLoop(), []

    def tick(n: int):
        seen.append((loop.now, n))
        return [(loop.now + 1.0, tick, n + 1)] if n < 10 else None

    loop.at(0.0, tick, 0)
    assert loop.run(until=3.5) == 3.5
    assert seen == [(0.0, 0), (1.0, 1), (2.0, 2), (3.0, 3)]
    with pytest.raises(ValueError):
        loop.at(1.0, tick, 0)  # in the past


def test_event_loop_is_deterministic():
    def trace() -> list[tuple[float, int]]:
        loop, seen = EventLoop(), []
        for i in range(50):
            loop.at((i * 7) % 5 * 0.5, lambda p: seen.append((loop.now, p)), i)
        loop.run()
        return seen

    assert trace() == trace()


# --------------------------------------------------------------------------- one rank


def _engine(capacity: int = 10_000, max_running: int | None = None):
    loop, done = EventLoop(), []
    cost = FakeCostModel(capacity)
    engine = RolloutEngine(0, loop, cost, SimKVCache(capacity, 16),
                           on_done=lambda r: done.append((loop.now, r.task_id)),
                           max_running=max_running)
    return loop, engine, done


def test_processor_sharing_finish_times_by_hand():
    loop, engine, done = _engine()
    loop.at(0.0, lambda _: engine.submit(SimRequest("a", "g", 32, 32, 10, 32)))
    loop.at(0.05, lambda _: engine.submit(SimRequest("b", "h", 16, 16, 5, 16)))
    loop.run()
    # a: prefill 32 tokens stalls the rank to 0.032, then 1.8 tokens by 0.05. b's prefill of 16
    # stalls both to 0.066; then b needs 5 steps (0.116) and a the 8.2 it has left (0.148).
    assert [task for _, task in done] == ["b", "a"]
    assert [t for t, _ in done] == pytest.approx([0.116, 0.148])
    assert engine.decoded_tokens == 15 and engine.prefill_tokens == 48


def test_a_request_waits_until_its_context_and_output_fit():
    """10 blocks of 16. a: 1 prompt block + 5 own (32 context + 40 output); b: 1 + 3. c needs
    2 and waits. a prefills to 0.048, b to 0.096; b's 16 tokens end at 0.256. Its blocks are
    cached; c evicts 2 of them (b's entry is least recently used), prefills 16 (to 0.272) and
    decodes 16 (0.432); a had 24 tokens left at 0.256 and ends at 0.272 + 0.24 = 0.512."""
    loop, engine, done = _engine(capacity=160)
    loop.at(0.0, lambda _: engine.submit(SimRequest("a", "g1", 16, 48, 40, 48)))
    loop.at(0.001, lambda _: engine.submit(SimRequest("b", "g2", 16, 48, 16, 48)))
    loop.at(0.002, lambda _: engine.submit(SimRequest("c", "g3", 16, 16, 16, 16)))
    loop.run()
    assert [task for _, task in done] == ["b", "c", "a"]
    assert [t for t, _ in done] == pytest.approx([0.256, 0.432, 0.512])
    assert engine.kv.evicted_tokens == 32 and engine.kv.num_preemptions == 0
    assert engine.decoded_tokens == 40 + 16 + 16


def test_with_nothing_running_a_waiting_request_gives_up_its_pinned_blocks():
    """10 blocks of 16. Turn 1 of a and b (prompt 16, own 32 + 16 output: 1 + 3 blocks each)
    prefill 96 tokens (to 0.096) and decode 16 (0.256); CTB pins their 8 blocks. At 1.0 both
    second turns (context 80, 32 to decode: 7 blocks each) queue: a needs 3 more of the 2 free
    and nothing runs to free one, so b, queued behind it, loses its 3 own blocks (48 tokens to
    compute again). a computes its 16 new tokens (to 1.016) and decodes 32 (1.336); b then
    waits for a's pinned blocks (a waits for its environment, as CTB pinned it)."""
    loop, engine, done = _engine(capacity=160)
    for task, group in (("a", "g1"), ("b", "g2")):
        loop.at(0.0, lambda _, t=task, g=group: engine.submit(SimRequest(t, g, 16, 48, 16, 48,
                                                                      pin=True)))
        loop.at(1.0, lambda _, t=task, g=group: engine.submit(SimRequest(t, g, 16, 80, 32, 16,
                                                                      pin=True)))
    loop.run()
    assert done == [(0.256, "a"), (0.256, "b"), (pytest.approx(1.336), "a")]
    assert (engine.kv.num_preemptions, engine.kv.preempted_tokens) == (1, 48)
    assert engine.prefill_tokens == 96 + 16 and engine.num_requests == 1


# --------------------------------------------------------------------------- the pool


def _plan(task_id: str, turns: list[tuple[int, int, float]]) -> TaskPlan:
    return TaskPlan(task_id, "g", "webshop", False, 32, 0.1,
                    tuple(TurnPlan(add, action, env) for add, action, env in turns), 1.0)


def test_two_tasks_on_one_rank_by_hand():
    """Group g (prompt 32): a = 2 turns, b = 1 turn; resets 0.1 s; request level, 16-token
    blocks. At 0.1 a computes its 48-token context (to 0.148); b hits the 2 prompt blocks and
    computes 16 (to 0.164); both decode from 0.164: a's 10 tokens end at 0.264, b's 20 at 0.364.
    b's env (0.2) ends it at 0.564. a's env (1.0) returns at 1.264: context 48 + 10 + 6 = 64
    hits the prompt and a's one full own block (48), computes 16 (to 1.280), decodes 4 (1.320),
    and its env (0.5) finishes the group at 1.820. Hits: 0 + 32 + 48 of 48 + 48 + 64 queried.
    a's first turn left 58 tokens, 48 in whole blocks: its second found all 48 (retention)."""
    loop, ready = EventLoop(), []
    policy = RequestLevelPolicy(CTBConfig(policy="request", request_concurrency=8))
    rollout = RolloutControl(policy, policy.config.new_book(), budget=1 << 20, max_new_tokens=32)
    pool = RolloutPool(loop, FakeCostModel(), rollout, round_interval_s=0.5, block_size=16,
                       max_running=None, on_group_ready=ready.append)
    rollout.add_rank(0, 0.0)
    pool.add_rank(0)
    plans = [_plan("a", [(16, 10, 1.0), (6, 4, 0.5)]), _plan("b", [(16, 20, 0.2)])]
    rollout.add_group(group_of(plans), 0.0)
    pool.add_group(plans)
    loop.run()
    assert len(ready) == 1 and ready[0].ready_time == pytest.approx(1.820)
    kv = pool.engines[0].kv
    assert (kv.query_tokens, kv.hit_tokens) == (160, 80)
    assert (rollout.reused_tokens, rollout.reusable_tokens) == (48, 48)
    assert pool.generated_tokens == (32 + 16 + 10 + 6 + 4) + (32 + 16 + 20)


@pytest.mark.parametrize("flush_s", [0.2, 0.5])
def test_a_context_from_before_a_weight_update_is_not_counted_as_reusable(flush_s):
    """As above, with the cache flushed while a's first turn decodes (0.2) or while its
    environment works (0.5): its second turn finds nothing of a's own, and counts nothing."""
    loop = EventLoop()
    policy = RequestLevelPolicy(CTBConfig(policy="request", request_concurrency=8))
    rollout = RolloutControl(policy, policy.config.new_book(), budget=1 << 20, max_new_tokens=32)
    pool = RolloutPool(loop, FakeCostModel(), rollout, round_interval_s=0.5, block_size=16,
                       max_running=None, on_group_ready=lambda group: None)
    rollout.add_rank(0, 0.0)
    pool.add_rank(0)
    plans = [_plan("a", [(16, 10, 1.0), (6, 4, 0.5)])]
    rollout.add_group(group_of(plans), 0.0)
    pool.add_group(plans)

    def flush(_) -> None:
        pool.engines[0].kv.flush()

    loop.at(flush_s, flush)
    loop.run()
    assert (rollout.reused_tokens, rollout.reusable_tokens) == (0, 0)


# --------------------------------------------------------------------------- trainer


def _mbs(n: int, tokens: int) -> list[MicroBatch]:
    return [MicroBatch(i, (SeqRef(f"{i}", tokens),)) for i in range(n)]


@pytest.mark.parametrize("kind", [StepMode.COLOCATED, StepMode.VSO, StepMode.BATCH,
                                  StepMode.DECOUPLED])
def test_executors_finish_after_their_work(kind):
    cost = CachedCostModel(MODELS["qwen2.5-7b"], GPUS["h100-sxm"])
    loop, ends = EventLoop(), []
    executor = build_executor(kind, loop, cost, num_gpus=2, num_ref=1, max_aggregate=8,
                              on_done=ends.append)
    for mb in _mbs(4, 4096):
        loop.at(0.0, executor.add, mb)
    loop.at(0.0, lambda _, ex=executor: ex.close())
    loop.run()
    work = 4 * (cost.actor_fwd_s(4096, 4096) + cost.actor_bwd_s(4096, 4096))
    assert len(ends) == 1 and ends[0] >= work / 2 and executor.samples == 4


def test_vanilla_streaming_pays_a_swap_pair_per_micro_batch():
    cost = CachedCostModel(MODELS["qwen2.5-7b"], GPUS["h100-sxm"])
    times = {}
    for kind in (StepMode.COLOCATED, StepMode.VSO):
        loop, ends = EventLoop(), []
        executor = build_executor(kind, loop, cost, num_gpus=4, num_ref=0, max_aggregate=8,
                                  on_done=ends.append)
        for mb in _mbs(8, 8192):
            loop.at(0.0, executor.add, mb)
        loop.at(0.0, lambda _, ex=executor: ex.close())
        loop.run()
        times[kind] = ends[0]
    # colocated aggregates all 8 ready ones: 2 swaps, its passes over their union; vso swaps
    # twice per micro-batch (16) and deals each micro-batch over the GPUs alone
    mbs = _mbs(8, 8192)
    apart = sum(ref_time(cost, mb, 4) + sum(actor_times(cost, mb, 4)) for mb in mbs)
    together = ref_time(cost, union(mbs), 4) + sum(actor_times(cost, union(mbs), 4))
    assert times["vso"] - times["colocated"] == pytest.approx(
        14 * cost.model_swap_s() + apart - together)


def test_cached_cost_model_matches_the_cost_model():
    plain = CostModel(MODELS["qwen2.5-14b"], GPUS["h100-sxm"])
    cached = CachedCostModel(MODELS["qwen2.5-14b"], GPUS["h100-sxm"])
    for batch, context in ((1, 0), (7, 12_345), (256, 900_000)):
        assert cached.decode_step_s(batch, context) == pytest.approx(
            plain.decode_step_s(batch, context), rel=1e-12)
    for tokens, seq in ((1, 1), (8192, 8192), (12_000, 3000)):
        for name in ("ref_fwd_s", "actor_fwd_s", "actor_bwd_s"):
            assert getattr(cached, name)(tokens, seq) == pytest.approx(
                getattr(plain, name)(tokens, seq), rel=1e-12)
    assert cached.prefill_s([(100, 50), (7, 0)]) == pytest.approx(
        plain.prefill_s([(100, 50), (7, 0)]), rel=1e-12)
    for chunk in ((1, 0), (333, 4096), (0, 64)):  # one sequence: the same sum, term for term
        assert cached.prefill_s([chunk]) == plain.prefill_s([chunk])


class FakeSmallRankCostModel(CachedCostModel):
    """Fake: the real 7B timings on a rank with only 30,000 KV tokens, to create memory
    pressure with a few dozen tasks (a real H100 holds ~0.97 M)."""

    def kv_capacity_tokens(self) -> int:
        return 30_000


def test_ctb_keeps_more_cache_than_request_level_under_memory_pressure():
    """One small rank (30,000 KV tokens) and 64 WebShop tasks: request-level admits them all and
    new turns evict the caches of tasks waiting for their environment; CTB admits by token
    budget and pins the active ones, so their next turns hit."""
    from tiderl.sim.config import SimConfig
    from tiderl.sim.scenario import SimScenario
    from tiderl.sim.single_gpu import simulate_rollout_step

    scenario = SimScenario(sim=SimConfig(workload="webshop"), job=JobShape(steps=10))
    cost = FakeSmallRankCostModel(MODELS["qwen2.5-7b"], GPUS["h100-sxm"])
    ctb = simulate_rollout_step(scenario, 64, ctb=True, concurrency=None, cost=cost)
    request = simulate_rollout_step(scenario, 64, ctb=False, concurrency=None, cost=cost)
    assert ctb.kv_hit_rate > request.kv_hit_rate
    assert ctb.recomputed_tokens < request.recomputed_tokens
