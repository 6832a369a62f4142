"""Scheduler: exact per-step decisions (tokens, positions, blocks) driven by a fake runner."""

from __future__ import annotations

import random

from tiderl.engine.config import EngineConfig
from tiderl.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from tiderl.engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

BS = 4
EOS = 2


class FakeModelRunner:
    """Stands in for the torch model runner (a true external edge of the scheduler).

    Samples token ``1000 + position`` of the token it produces (so a recomputed request samples
    what it would have sampled anyway), with logprob -1.0; ``eos_at`` maps a request id to the
    output index at which it samples EOS instead. Records every SchedulerOutput it executes.
    """

    def __init__(self, eos_at: dict[str, int] | None = None) -> None:
        self.eos_at = eos_at or {}
        self.steps: list[SchedulerOutput] = []

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(output)
        tokens, logprobs = {}, {}
        for item in output.scheduled:
            if item.samples:
                eos = self.eos_at.get(item.request_id) == item.num_output_tokens
                tokens[item.request_id] = EOS if eos else 1000 + item.positions[-1] + 1
                logprobs[item.request_id] = -1.0
        return ModelRunnerOutput(tokens, logprobs)


def scheduler(kv_tokens=64, budget=32, max_num_seqs=8):
    config = EngineConfig(kv_cache_tokens=kv_tokens, block_size=BS, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget)
    return Scheduler(config, eos_token_id=EOS)


def req(rid, tokens, max_tokens=4, task=None):
    return Request(rid, task or rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def step(sched, runner):
    return sched.update(runner.execute(sched.schedule()))


def run(sched, runner, max_steps=100):
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return finished
        finished += step(sched, runner)
    raise AssertionError("did not finish")


def chunks(runner, rid):
    """Per step, the number of tokens computed for ``rid`` (0 when not scheduled)."""
    return [sum(len(s.token_ids) for s in out.scheduled if s.request_id == rid)
            for out in runner.steps]


def test_prefill_then_decode_with_exact_positions_blocks_and_slots():
    sched, runner = scheduler(), FakeModelRunner()
    a = req("a", range(10, 20), max_tokens=3)
    sched.add_request(a)
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.token_ids == list(range(10, 20)) and item.positions == list(range(10))
    assert item.block_table == [0, 1, 2] and item.slot_mapping == list(range(10))
    assert item.samples and out.num_batched_tokens == 10
    sched.update(runner.execute(out))
    assert a.output_token_ids == [1010] and a.status is RequestStatus.RUNNING
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.token_ids, item.positions, item.slot_mapping) == ([1010], [10], [10])
    sched.update(runner.execute(out))
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.positions == [11] and item.slot_mapping == [11]
    assert sched.update(runner.execute(out)) == [a]
    assert a.output_token_ids == [1010, 1011, 1012] and a.output_logprobs == [-1.0] * 3
    assert a.status is RequestStatus.FINISHED and a.finish_reason is FinishReason.LENGTH
    assert a.block_ids == [] and sched.kv_cache.kv_cache_usage_perc == 0.0
    assert sched.kv_cache.pool.num_cached_free_blocks == 3  # 12 computed tokens, all full


def test_eos_finishes_a_request():
    sched, runner = scheduler(), FakeModelRunner(eos_at={"a": 1})
    a = req("a", range(10, 15), max_tokens=8)
    sched.add_request(a)
    assert run(sched, runner) == [a]
    assert a.output_token_ids == [1005, EOS] and a.finish_reason is FinishReason.STOP


def test_turn_two_computes_only_the_tokens_not_in_the_cache():
    """Turn 1 computes prompt + all outputs but the last; turn 2 (= turn 1's context + the
    environment's reply) hits every full block of it and computes the rest: the last output of
    turn 1, the reply, and the tail of the partial block."""
    sched, runner = scheduler(), FakeModelRunner()
    t1 = req("t1", range(10, 17), max_tokens=2, task="task")  # 7 + 2 tokens, 8 computed
    sched.add_request(t1)
    run(sched, runner)
    context = t1.prompt_token_ids + t1.output_token_ids
    assert context == [*range(10, 17), 1007, 1008]
    t2 = req("t2", [*context, 50, 51, 52], max_tokens=1, task="task")
    sched.add_request(t2)
    runner.steps.clear()
    run(sched, runner)
    (item,) = runner.steps[0].scheduled
    assert item.token_ids == [1008, 50, 51, 52] and item.positions == [8, 9, 10, 11]
    assert item.block_table[:2] == [0, 1] and t2.num_cached_tokens == 8
    assert chunks(runner, "t2") == [4]
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (7 + 12, 8)


def test_finished_blocks_are_cached_and_hit_by_the_next_request():
    sched, runner = scheduler(), FakeModelRunner()
    a = req("a", range(8), max_tokens=1)
    sched.add_request(a)
    run(sched, runner)
    assert sched.kv_cache.pool.free_block_ids()[-2:] == [1, 0]
    b = req("b", [*range(8), 70, 71, 72], max_tokens=1)
    sched.add_request(b)
    (item,) = sched.schedule().scheduled
    assert item.block_table == [0, 1, 2] and item.token_ids == [70, 71, 72]
    assert item.slot_mapping == [8, 9, 10]


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget():
    sched, runner = scheduler(budget=8), FakeModelRunner()
    a, b = req("a", range(100, 103), max_tokens=5), req("b", range(20), max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    run(sched, runner)
    assert chunks(runner, "a") == [3, 1, 1, 1, 1]  # running requests decode first
    assert chunks(runner, "b") == [5, 7, 7, 1, 0]  # ...and the prompt fills the rest
    assert [out.num_batched_tokens for out in runner.steps] == [8, 8, 8, 2, 1]
    samples = [[s.request_id for s in out.scheduled if s.samples] for out in runner.steps]
    assert samples == [["a"], ["a"], ["a"], ["a", "b"], ["a"]]
    b_items = [s for out in runner.steps for s in out.scheduled if s.request_id == "b"]
    assert [s.positions[0] for s in b_items] == [0, 5, 12, 19]
    assert b.output_token_ids == [1020] and len(a.output_token_ids) == 5


def test_max_num_seqs_bounds_the_running_requests():
    sched, runner = scheduler(max_num_seqs=2), FakeModelRunner()
    reqs = [req(f"r{i}", range(10 * i, 10 * i + 3), max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert (sched.stats().num_requests_running, sched.stats().num_requests_waiting) == (2, 1)
    sched.update(runner.execute(out))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    sched.update(runner.execute(out))  # r0 and r1 finish
    assert [s.request_id for s in sched.schedule().scheduled] == ["r2"]


def test_the_waiting_head_waits_for_blocks_without_preempting():
    sched, runner = scheduler(kv_tokens=16), FakeModelRunner()  # 4 blocks
    a, b = req("a", range(10), max_tokens=2), req("b", range(50, 58), max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a"]  # b needs 2 blocks, 1 is free
    sched.update(runner.execute(out))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a"]
    sched.update(runner.execute(out))  # a finishes
    assert [s.request_id for s in sched.schedule().scheduled] == ["b"]
    assert sched.num_preemptions == 0


def test_preemption_by_recompute_when_blocks_run_out():
    sched, runner = scheduler(kv_tokens=16), FakeModelRunner()  # 4 blocks
    a, b = req("a", range(4), max_tokens=6), req("b", range(10, 14), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(5):  # prefill, then decode up to 8 tokens each: 2 blocks each
        step(sched, runner)
    assert (a.block_ids, b.block_ids) == ([0, 2], [1, 3])
    out = sched.schedule()  # a's 9th token needs a block: b, admitted last, is preempted
    assert out.preempted_ids == ["b"] and [s.request_id for s in out.scheduled] == ["a"]
    assert a.block_ids == [0, 2, 3]  # b's tail block was freed first, so it is reused first
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.block_ids == [] and list(sched.waiting) == [b]
    assert sched.update(runner.execute(out)) == [a]
    out = sched.schedule()  # b recomputes: its first block is still cached
    (item,) = out.scheduled
    assert item.block_table == [1, 3, 2] and item.token_ids == [1004, 1005, 1006, 1007, 1008]
    assert sched.update(runner.execute(out)) == [b]
    assert b.output_token_ids == a.output_token_ids == list(range(1004, 1010))
    assert (sched.num_preemptions, b.num_preemptions) == (1, 1)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 + 4 + 9, 4)
    assert stats.kv_cache_usage_perc == 0.0


def test_abort_frees_the_blocks():
    sched, runner = scheduler(), FakeModelRunner()
    a = req("a", range(10))
    sched.add_request(a)
    step(sched, runner)
    assert sched.abort_request("a") is a
    assert a.finish_reason is FinishReason.ABORT and not sched.has_unfinished
    assert sched.kv_cache.kv_cache_usage_perc == 0.0


def check_invariants(sched, out):
    kv = sched.kv_cache
    holders = {b.block_id: 0 for b in kv.pool.blocks}
    for r in sched.running:
        assert len(r.block_ids) * BS >= r.num_computed_tokens
        for block_id in r.block_ids:
            holders[block_id] += 1
    for blocks in kv._pins.values():
        for b in blocks:
            holders[b.block_id] += 1
    assert holders == {b.block_id: b.ref_cnt for b in kv.pool.blocks}
    assert sorted(kv.pool.free_block_ids()) == sorted(i for i, n in holders.items() if n == 0)
    assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs


def test_random_multi_turn_tasks_keep_the_invariants_and_all_complete():
    """Pins are dropped when a task ends; CTB keeps pinned footprints within the pool."""
    rng = random.Random(0)
    sched, runner = scheduler(kv_tokens=64, budget=10, max_num_seqs=3), FakeModelRunner()
    turns = {f"t{i}": 0 for i in range(5)}
    for task in turns:
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 12))]
        sched.add_request(req(f"{task}-0", prompt, max_tokens=rng.randrange(1, 6), task=task))
    done = 0
    for _ in range(500):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        for r in sched.update(runner.execute(out)):
            assert r.output_token_ids == [1000 + r.num_prompt_tokens + i
                                          for i in range(r.num_output_tokens)]
            done += 1
            task = r.task_id
            turns[task] += 1
            if turns[task] == 3:
                sched.kv_cache.forget_task(task)
                continue
            if rng.random() < 0.5:
                sched.kv_cache.pin(task)
            else:
                sched.kv_cache.unpin(task)
            context = [*r.prompt_token_ids, *r.output_token_ids, 7, 8]
            sched.add_request(req(f"{task}-{turns[task]}", context,
                                  max_tokens=rng.randrange(1, 6), task=task))
        check_invariants(sched, out)
    assert done == 15 and not sched.has_unfinished
    assert sched.stats().prefix_cache_hits > 0
    assert sched.kv_cache.token_usage().num_used_tokens == 0
