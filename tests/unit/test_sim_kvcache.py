"""SimKVCache: exact block and token accounting on hand-built sequences (block 16 throughout)."""

import random

import pytest

from tiderl.sim.kvcache import SimKVCache, TurnAlloc

BS = 16


def cache(tokens=64):
    return SimKVCache(capacity_tokens=tokens, block_size=BS)


def check_invariants(kv):
    used = sum(e.blocks for e in kv._tasks.values()) + sum(e.blocks for e in kv._groups.values())
    assert used * BS == kv.used_tokens <= kv.capacity_tokens
    assert sum(e.blocks for e in kv._lru) * BS == kv.cached_tokens
    assert kv.free_tokens == kv.capacity_tokens - kv.used_tokens
    assert kv.referenced_tokens == kv.used_tokens - kv.cached_tokens
    for entry in kv._lru:
        assert entry.blocks > 0 and entry.valid == entry.blocks


def test_capacity_is_whole_blocks():
    assert SimKVCache(100, 16).capacity_tokens == 96
    with pytest.raises(ValueError):
        SimKVCache(64, 0)


def test_turn_extending_a_resident_context():
    kv = cache(64)  # 4 blocks
    assert kv.begin_turn("a", "g", 0, 20, now=0.0) == TurnAlloc(hit_tokens=0, compute_tokens=20)
    assert kv.used_tokens == 32  # 2 blocks, the second partial
    assert kv.grow("a", 10, now=1.0)  # 30 tokens, still 2 blocks
    assert kv.used_tokens == 32
    kv.end_turn("a", now=2.0)
    assert kv.cached_tokens == 16 and kv.used_tokens == 16  # the partial block is freed
    # turn 2 (context 40): one full block hits; the partial second block is recomputed
    assert kv.begin_turn("a", "g", 0, 40, now=3.0) == TurnAlloc(16, 24)
    assert kv.used_tokens == 48 and kv.cached_tokens == 0
    assert (kv.query_tokens, kv.hit_tokens) == (60, 16)
    assert kv.hit_rate == pytest.approx(16 / 60)
    check_invariants(kv)


def test_block_aligned_context_recomputes_the_last_block():
    kv = cache(64)
    kv.begin_turn("a", "g", 0, 16, now=0.0)
    assert kv.grow("a", 16, now=0.5)  # 32 tokens: 2 full blocks
    kv.end_turn("a", now=1.0)
    assert kv.cached_tokens == 32
    # context 32 again: at most (32 - 1) // 16 = 1 block may hit (vLLM computes the last token)
    assert kv.begin_turn("a", "g", 0, 32, now=2.0) == TurnAlloc(16, 16)


def test_grow_allocates_at_block_boundaries_and_fails_without_room():
    kv = cache(64)
    kv.begin_turn("a", "g", 0, 16, now=0.0)
    assert kv.used_tokens == 16
    assert kv.grow("a", 1, now=0.1) and kv.used_tokens == 32
    assert kv.grow("a", 31, now=0.2) and kv.used_tokens == 48  # 48 tokens
    assert kv.grow("a", 16, now=0.3) and kv.used_tokens == 64  # 64 tokens = capacity
    assert not kv.grow("a", 1, now=0.4)  # no block left and nothing cached
    assert kv.used_tokens == 64 and kv.task_blocks("a") == 4
    check_invariants(kv)


def test_group_prompt_is_shared_by_a_sibling():
    kv = cache(128)  # 8 blocks
    # prompt 40 tokens: 2 shared full blocks; the prompt's partial block belongs to the task
    assert kv.begin_turn("a", "g", 40, 50, now=0.0) == TurnAlloc(0, 50)
    assert kv.used_tokens == 64  # 2 shared + ceil(18 / 16) = 2 own blocks
    assert kv.begin_turn("b", "g", 40, 45, now=0.1) == TurnAlloc(32, 13)
    assert kv.used_tokens == 80  # b adds only its own block (45 - 32 = 13 tokens)
    kv.end_turn("a", now=1.0)
    kv.end_turn("b", now=1.1)
    # a's own entry keeps 1 full block (tokens 32..47), b's none (13 tokens); prompt 2 blocks
    assert kv.cached_tokens == 48
    assert kv.begin_turn("c", "g", 40, 60, now=2.0) == TurnAlloc(32, 28)
    check_invariants(kv)


def test_lru_evicts_the_oldest_entry_first():
    kv = cache(64)
    for i, task in enumerate(("a", "b")):
        kv.begin_turn(task, f"g{task}", 0, 32, now=float(i))
        kv.end_turn(task, now=10.0 + i)  # a then b: a is older
    assert kv.cached_tokens == 64 and kv.free_tokens == 0
    assert kv.begin_turn("c", "gc", 0, 17, now=20.0) == TurnAlloc(0, 17)  # needs 2 blocks
    assert kv.evicted_tokens == 32
    assert kv.task_blocks("a") == 0 and kv.task_blocks("b") == 2  # a was older
    assert kv.peek_turn("a", "ga", 0, 30) == TurnAlloc(0, 30)
    assert kv.peek_turn("b", "gb", 0, 30) == TurnAlloc(16, 14)
    check_invariants(kv)


def test_lru_order_follows_last_use_not_creation():
    kv = cache(64)
    kv.begin_turn("a", "ga", 0, 32, now=0.0)
    kv.begin_turn("b", "gb", 0, 32, now=1.0)
    kv.end_turn("b", now=2.0)
    kv.end_turn("a", now=3.0)  # a used last: b is evicted first
    kv.begin_turn("c", "gc", 0, 20, now=4.0)
    assert kv.task_blocks("b") == 0 and kv.task_blocks("a") == 2


def test_eviction_takes_tail_blocks_first():
    kv = cache(80)  # 5 blocks
    kv.begin_turn("a", "ga", 0, 48, now=0.0)  # 3 full blocks
    kv.end_turn("a", now=1.0)
    kv.begin_turn("b", "gb", 0, 40, now=2.0)  # needs 3: 2 free + 1 evicted from a's tail
    assert kv.evicted_tokens == 16
    assert kv.task_blocks("a") == 2
    kv.end_turn("b", now=3.0)
    assert kv.peek_turn("a", "ga", 0, 60) == TurnAlloc(32, 28)  # the prefix still hits
    check_invariants(kv)


def test_group_prompt_outlives_its_tasks_in_lru():
    kv = cache(64)
    kv.begin_turn("a", "g", 32, 48, now=0.0)  # 2 prompt blocks + 1 own
    kv.end_turn("a", now=1.0)  # the task's block is queued before the group's
    kv.begin_turn("x", "gx", 0, 16, now=2.0)  # 1 free block
    kv.begin_turn("y", "gy", 0, 16, now=3.0)  # evicts a's own block, not the prompt
    assert kv.task_blocks("a") == 0
    kv.end_turn("x", now=4.0)
    assert kv.peek_turn("b", "g", 32, 40) == TurnAlloc(32, 8)
    check_invariants(kv)


def test_broken_prompt_prefix_disables_the_task_hit():
    # The group entry is normally more recent than its tasks' own entries; the order is
    # forced here to check the prefix-chain rule.
    kv = cache(96)  # 6 blocks
    kv.begin_turn("a", "g", 32, 64, now=0.0)  # 2 prompt + 2 own blocks
    kv.end_turn("a", now=1.0)
    kv.release("z")  # unknown task: no effect
    kv.begin_turn("x", "gx", 0, 32, now=2.0)  # the 2 free blocks
    kv._lru.move_to_end(next(iter(kv._lru)))  # make the group entry oldest (hand-built state)
    kv.begin_turn("y", "gy", 0, 16, now=3.0)  # evicts the prompt's tail block
    kv.end_turn("x", now=4.0)
    kv.end_turn("y", now=4.0)
    assert kv.task_blocks("a") == 2
    assert kv.peek_turn("a", "g", 32, 70) == TurnAlloc(16, 54)  # own blocks unreachable


def test_pinned_blocks_are_never_evicted():
    kv = cache(64)
    kv.begin_turn("a", "ga", 0, 32, now=0.0)
    kv.pin("a")
    kv.end_turn("a", now=1.0)
    assert kv.referenced_tokens == 32 and kv.cached_tokens == 0
    kv.begin_turn("b", "gb", 0, 32, now=2.0)
    assert kv.begin_turn("c", "gc", 0, 1, now=3.0) is None  # a is pinned, b runs
    kv.unpin("a")
    assert kv.cached_tokens == 32
    assert kv.begin_turn("c", "gc", 0, 1, now=4.0) == TurnAlloc(0, 1)
    assert kv.task_blocks("a") == 1  # its tail block went
    check_invariants(kv)


def test_pinned_task_keeps_its_partial_block_and_hits_full_blocks():
    kv = cache(64)
    kv.begin_turn("a", "g", 0, 20, now=0.0)
    kv.pin("a")
    kv.end_turn("a", now=1.0)
    assert kv.referenced_tokens == 32  # the partial block stays allocated while pinned
    assert kv.begin_turn("a", "g", 0, 40, now=2.0) == TurnAlloc(16, 24)
    assert kv.used_tokens == 48


def test_pin_before_the_task_arrives():
    kv = cache(32)
    kv.pin("a")
    kv.begin_turn("a", "g", 0, 32, now=0.0)
    kv.end_turn("a", now=1.0)
    assert kv.cached_tokens == 0 and kv.referenced_tokens == 32
    kv.release("a")
    assert kv.used_tokens == 0


def test_none_when_it_cannot_fit_and_nothing_changes():
    kv = cache(64)
    kv.begin_turn("a", "ga", 0, 40, now=0.0)  # 3 blocks, running
    kv.begin_turn("b", "gb", 0, 16, now=0.5)
    kv.end_turn("b", now=0.6)  # 1 cached block
    before = (kv.used_tokens, kv.cached_tokens, kv.query_tokens, kv.evicted_tokens)
    assert kv.begin_turn("c", "gc", 0, 17, now=1.0) is None  # needs 2, only 1 obtainable
    assert (kv.used_tokens, kv.cached_tokens, kv.query_tokens, kv.evicted_tokens) == before
    assert not kv.has_task("c")
    assert kv.begin_turn("c", "gc", 0, 16, now=1.0) == TurnAlloc(0, 16)  # exactly fits
    check_invariants(kv)


def test_a_turn_may_reuse_its_own_cached_blocks_under_pressure():
    kv = cache(48)
    kv.begin_turn("a", "g", 0, 32, now=0.0)
    kv.end_turn("a", now=1.0)
    kv.begin_turn("b", "gb", 0, 16, now=2.0)  # 0 free blocks now
    assert kv.begin_turn("a", "g", 0, 40, now=3.0) is None  # needs 1 more: nothing evictable
    kv.end_turn("b", now=4.0)
    assert kv.begin_turn("a", "g", 0, 40, now=5.0) == TurnAlloc(32, 8)  # evicts b, keeps own
    check_invariants(kv)


def test_flush_makes_the_next_turn_miss():
    kv = cache(128)
    kv.begin_turn("a", "g", 32, 48, now=0.0)
    kv.end_turn("a", now=1.0)  # cached: 2 prompt + 1 own
    kv.begin_turn("b", "g", 32, 40, now=2.0)  # running: references the prompt
    kv.pin("c")
    kv.begin_turn("c", "gc", 0, 32, now=2.5)
    kv.end_turn("c", now=2.6)  # pinned, referenced
    assert kv.flush() == 16  # only a's own cached block; the prompt is referenced by b
    assert kv.peek_turn("c", "gc", 0, 40) == TurnAlloc(0, 40)  # stale though still allocated
    assert kv.referenced_tokens == 32 + 16 + 32
    kv.end_turn("b", now=3.0)  # stale: b's blocks and the prompt are freed, not cached
    assert kv.cached_tokens == 0
    assert kv.begin_turn("a", "g", 32, 56, now=4.0) == TurnAlloc(0, 56)
    assert kv.flushed_tokens == 16
    check_invariants(kv)


def test_flush_while_running_then_fresh_turns_hit_again():
    kv = cache(64)
    kv.begin_turn("a", "g", 0, 32, now=0.0)
    kv.flush()
    kv.end_turn("a", now=1.0)
    assert kv.begin_turn("a", "g", 0, 40, now=2.0) == TurnAlloc(0, 40)
    kv.end_turn("a", now=3.0)
    assert kv.begin_turn("a", "g", 0, 50, now=4.0) == TurnAlloc(32, 18)


def test_preemption_drops_blocks_and_counts():
    kv = cache(64)
    kv.begin_turn("a", "g", 16, 40, now=0.0)  # 1 prompt + 2 own blocks (24 own tokens)
    assert kv.preempt("a", now=1.0) == 24
    assert kv.num_preemptions == 1 and kv.preempted_tokens == 24
    assert not kv.is_running("a") and kv.task_blocks("a") == 0
    assert kv.cached_tokens == 16  # the prompt is cached, the task's blocks are gone
    assert kv.begin_turn("a", "g", 16, 40, now=2.0) == TurnAlloc(16, 24)
    check_invariants(kv)


def test_release_frees_own_blocks_and_caches_the_last_prompt_reference():
    kv = cache(128)
    kv.begin_turn("a", "g", 32, 48, now=0.0)
    kv.begin_turn("b", "g", 32, 48, now=0.0)
    kv.release("a")  # running request released: own block freed, prompt still held by b
    assert kv.used_tokens == 48 and kv.cached_tokens == 0
    kv.end_turn("b", now=1.0)
    kv.release("b")
    assert kv.cached_tokens == 32 and kv.used_tokens == 32  # only the prompt, cached
    assert kv.begin_turn("c", "g", 32, 40, now=2.0) == TurnAlloc(32, 8)
    check_invariants(kv)


def test_abort_turn_keeps_only_the_hits():
    kv = cache(128)
    kv.begin_turn("a", "g", 32, 64, now=0.0)  # 2 prompt + 2 own blocks
    kv.end_turn("a", now=1.0)
    assert kv.begin_turn("a", "g", 32, 100, now=2.0) == TurnAlloc(64, 36)
    kv.abort_turn("a", now=2.0)  # never ran: the 3rd own block and the partial are not valid
    assert kv.cached_tokens == 64 and kv.num_preemptions == 0
    assert kv.begin_turn("a", "g", 32, 100, now=3.0) == TurnAlloc(64, 36)
    kv.abort_turn("a", now=3.0)
    assert kv.begin_turn("b", "g2", 20, 30, now=4.0) == TurnAlloc(0, 30)
    kv.abort_turn("b", now=4.0)  # its own prompt was never computed either
    assert kv.peek_turn("c", "g2", 20, 30) == TurnAlloc(0, 30)
    check_invariants(kv)


def test_kept_prefix_caps_the_hit():
    kv = cache(128)
    kv.begin_turn("a", "g", 0, 64, now=0.0)
    kv.end_turn("a", now=1.0)
    assert kv.begin_turn("a", "g", 0, 80, now=2.0, kept_prefix=40) == TurnAlloc(32, 48)


def test_context_shrink_frees_blocks():
    kv = cache(128)
    kv.begin_turn("a", "g", 0, 64, now=0.0)
    kv.pin("a")
    kv.end_turn("a", now=1.0)
    kv.begin_turn("a", "g", 0, 20, now=2.0, kept_prefix=16)
    assert kv.used_tokens == 32


def test_misuse_raises():
    kv = cache(64)
    kv.begin_turn("a", "g", 0, 16, now=0.0)
    with pytest.raises(ValueError):
        kv.begin_turn("a", "g", 0, 16, now=0.0)
    with pytest.raises(ValueError):
        kv.grow("b", 1, now=0.0)
    kv.end_turn("a", now=1.0)
    with pytest.raises(ValueError):
        kv.end_turn("a", now=1.0)


def test_random_workload_keeps_the_invariants():
    rng = random.Random(7)
    kv = SimKVCache(capacity_tokens=4000, block_size=BS)
    contexts: dict[str, int] = {}
    now = 0.0
    for _ in range(4000):
        now += 1.0
        task = f"t{rng.randrange(40)}"
        group = f"g{int(task[1:]) // 5}"
        op = rng.random()
        if kv.is_running(task):
            if op < 0.5:
                grown = rng.randrange(1, 60)
                if kv.grow(task, grown, now):
                    contexts[task] += grown
                else:
                    kv.preempt(task, now)
            elif op < 0.85:
                kv.end_turn(task, now)
            elif op < 0.9:
                kv.abort_turn(task, now)
            else:
                kv.release(task)
                contexts.pop(task, None)
        elif op < 0.8:
            context = contexts.get(task, 100) + rng.randrange(0, 200)
            alloc = kv.begin_turn(task, group, 100, context, now)
            if alloc is not None:
                assert alloc.hit_tokens + alloc.compute_tokens == context
                assert alloc.hit_tokens % BS == 0 and alloc.compute_tokens >= 1
                contexts[task] = context
        elif op < 0.85:
            kv.pin(task)
        elif op < 0.9:
            kv.unpin(task)
        elif op < 0.92:
            kv.flush()
        else:
            kv.release(task)
            contexts.pop(task, None)
        check_invariants(kv)
    assert kv.hit_tokens > 0 and kv.evicted_tokens > 0
