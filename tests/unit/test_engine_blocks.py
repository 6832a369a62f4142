"""Block pool and KV cache manager: exact block ids, hashes, refcounts and eviction order.

Block size 4 throughout; a "computed" step is simulated by advancing num_computed_tokens and
calling cache_blocks, as the scheduler does after the model runner ran.
"""

from __future__ import annotations

import pytest

from tiderl.engine import block_pool
from tiderl.engine.block_pool import ROOT_HASH, hash_block_tokens
from tiderl.engine.config import EngineConfig
from tiderl.engine.kv_cache_manager import KVCacheManager, PinRefused, TokenUsage
from tiderl.engine.request import Request

BS = 4


def manager(num_blocks=10):
    return KVCacheManager(num_blocks, BS)


def req(rid, tokens, task=None):
    return Request(rid, task or rid, list(tokens))


def start(kv, request):
    """Admit a request: prefix hits, blocks for the rest, compute it all. Returns hit block ids."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return [b.block_id for b in hits]


def test_pool_size_is_fixed_by_the_config():
    kv = KVCacheManager.from_config(EngineConfig(kv_cache_tokens=100, block_size=16))
    assert kv.pool.num_blocks == 6
    assert kv.token_usage() == TokenUsage(96, 0, 0, 0, 96)


def test_block_ids_in_order_and_only_full_blocks_hashed_chained():
    kv = manager()
    a = req("a", range(10))
    assert start(kv, a) == []
    assert a.block_ids == [0, 1, 2] == kv.get_block_ids("a")
    b0, b1, b2 = kv.pool.blocks[:3]
    assert b0.block_hash == hash_block_tokens(ROOT_HASH, (0, 1, 2, 3))
    assert b1.block_hash == hash_block_tokens(b0.block_hash, (4, 5, 6, 7))
    assert b0.token_ids == (0, 1, 2, 3) and b1.token_ids == (4, 5, 6, 7)
    assert b2.block_hash is None and b2.token_ids is None  # partial: 2 of 4 slots
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [1, 1, 1, 0]
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]


def test_a_partial_block_is_hashed_once_it_fills():
    kv = manager()
    a = req("a", range(6))
    start(kv, a)
    assert kv.pool.blocks[1].block_hash is None
    for token in (6, 7):
        a.append_output(token, 0.0)
        assert kv.allocate(a, 1) == []  # block 1 still has room
        a.num_computed_tokens += 1
        kv.cache_blocks(a)
    assert kv.pool.blocks[1].token_ids == (4, 5, 6, 7)


def test_hits_only_on_full_blocks_whose_tokens_and_parents_match():
    kv = manager()
    a = req("a", range(10))
    start(kv, a)
    kv.free(a)
    hits = [kv.get_computed_blocks(req(f"q{i}", t))[0] for i, t in enumerate([
        [*range(8), 99],  # both full blocks match
        range(8),  # same 8 tokens: the last token is always computed, so only block 0
        [0, 1, 2, 3, 4, 5, 6, 99, 8],  # block 1 differs
        [0, 1, 2, 3, 4, 5],  # block 1 not full
        [9, 1, 2, 3, 4, 5, 6, 7, 8],  # block 0 differs: block 1 cannot hit, its parent differs
    ])]
    assert [[b.block_id for b in h] for h in hits] == [[0, 1], [0], [0], [0], []]


def test_a_hash_collision_is_never_a_hit(monkeypatch):
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent, tokens: 7)
    kv = manager()
    a = req("a", [1, 1, 1, 1, 2, 2, 2, 2, 5])
    start(kv, a)
    kv.free(a)
    b = req("b", [3, 3, 3, 3, 2, 2, 2, 2, 5])
    assert start(kv, b) == []  # same hash as a's block 0, other tokens: computed again
    assert b.block_ids == [3, 4, 5]
    assert kv.pool.blocks[3].block_hash is None  # the collision is not cached over a's block
    assert kv.pool.blocks[4].block_hash is None  # nor anything below it
    kv.free(b)
    hits, num_hit = kv.get_computed_blocks(req("c", [1, 1, 1, 1, 2, 2, 2, 2, 6]))
    assert [h.block_id for h in hits] == [0] and num_hit == 4  # block 1 collides with block 0
    assert kv.get_computed_blocks(req("d", [3, 3, 3, 3, 2, 2, 2, 2, 6])) == ([], 0)


def test_free_is_tail_first_and_eviction_is_least_recently_freed_first():
    kv = manager()
    a, b = req("a", range(10)), req("b", range(100, 108))
    start(kv, a)
    start(kv, b)
    assert b.block_ids == [3, 4]
    kv.free(a)
    kv.free(b)
    assert kv.pool.free_block_ids() == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert kv.pool.num_cached_free_blocks == 4  # 0, 1, 3, 4 (block 2 was partial)
    c = req("c", range(200, 224))
    start(kv, c)
    assert c.block_ids == [5, 6, 7, 8, 9, 2]
    d = req("d", range(300, 304))
    start(kv, d)
    assert d.block_ids == [1]  # a's tail block is evicted before its head
    assert kv.pool.blocks[1].token_ids == (300, 301, 302, 303)
    assert [b.block_id for b in kv.get_computed_blocks(req("a2", range(10)))[0]] == [0]
    assert [b.block_id for b in kv.get_computed_blocks(req("b2", range(100, 109)))[0]] == [3, 4]


def test_refcounts_of_a_shared_prefix():
    kv = manager()
    a = req("a", range(9))
    start(kv, a)
    b = req("b", [*range(8), 50, 51])
    assert start(kv, b) == [0, 1]
    assert b.block_ids == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [1, 1, 0, 1]
    assert kv.pool.free_block_ids()[-1] == 2
    kv.free(b)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_can_allocate_is_separate_and_allocate_returns_none_without_room():
    kv = manager(4)
    a = req("a", range(12))
    start(kv, a)
    b = req("b", range(50, 58))
    assert not kv.can_allocate(b, 8)
    assert kv.allocate(b, 8) is None
    assert b.block_ids == [] and kv.pool.free_block_ids() == [3]  # nothing changed
    assert kv.can_allocate(b, 4)
    assert [blk.block_id for blk in kv.allocate(b, 4)] == [3]


def test_unreferenced_hit_blocks_count_against_the_free_blocks():
    kv = manager(3)
    a = req("a", range(8))
    start(kv, a)
    kv.free(a)
    b = req("b", range(13))  # hits 2 cached blocks, needs 2 new: 4 > 3
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert not kv.can_allocate(b, 5, hits)
    assert kv.allocate(b, 5, hits) is None
    assert kv.pool.num_free_blocks == 3
    c = req("c", range(11))  # hits 2, needs 1 new: 3
    hits, _ = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in kv.allocate(c, 3, hits)] == [2]
    assert c.block_ids == [0, 1, 2]


def test_pinned_blocks_survive_pressure_with_no_request_running():
    kv = manager(6)
    a = req("a1", range(9), task="a")
    start(kv, a)
    assert kv.pin("a") == 0  # nothing cached yet: the pin takes the context when a1 is freed
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:3]] == [1, 1, 0]
    assert kv.token_usage() == TokenUsage(24, 8, 8, 0, 16)
    big = req("big", range(100, 124))
    assert kv.allocate(big, 24) is None  # would need the pinned blocks
    assert big.block_ids == []
    assert [blk.block_id for blk in kv.allocate(big, 16)] == [3, 4, 5, 2]
    kv.free(big)
    turn2 = req("a2", [*range(9), 42, 43], task="a")
    assert start(kv, turn2) == [0, 1]
    kv.free(turn2)  # the pin moves to turn 2's context (still blocks 0, 1: block 2 is partial)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:3]] == [1, 1, 0]
    kv.unpin("a")
    assert kv.token_usage().num_pinned_tokens == 0
    assert kv.pool.free_block_ids()[-2:] == [1, 0]  # tail first
    assert kv.pin("a") == 2  # pinning an idle task holds its still-cached prefix
    assert kv.pool.num_free_blocks == 4


def test_a_pin_moves_to_the_newest_context():
    kv = manager(8)
    t1 = req("t1", range(5), task="a")
    start(kv, t1)
    kv.pin("a")
    kv.free(t1)
    assert kv.pool.blocks[0].ref_cnt == 1
    t2 = req("t2", range(13), task="a")
    assert start(kv, t2) == [0]
    assert t2.block_ids == [0, 2, 3, 4]
    kv.free(t2)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:5]] == [1, 0, 1, 1, 0]
    assert kv.token_usage().num_pinned_tokens == 12


def test_prefix_cache_counters_and_usage_in_tokens():
    kv = manager(10)
    a = req("a", range(10))
    start(kv, a)
    assert (kv.num_prefix_cache_queries, kv.num_prefix_cache_hits) == (10, 0)
    assert kv.kv_cache_usage_perc == 0.3
    kv.free(a)
    assert kv.kv_cache_usage_perc == 0.0
    assert kv.token_usage() == TokenUsage(40, 0, 0, 8, 40)
    start(kv, req("b", range(12)))
    assert (kv.num_prefix_cache_queries, kv.num_prefix_cache_hits) == (22, 8)


def test_reset_prefix_cache_forgets_every_content():
    kv = manager()
    a = req("a", range(9), task="t")
    start(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert kv.pin("t") == 0
    assert kv.pool.num_cached_free_blocks == 0


def test_a_child_cached_under_an_evicted_parent_is_not_hit_through_a_colliding_new_parent():
    pool = block_pool.BlockPool(3)
    parent, child = pool.get_new_blocks(2)
    assert pool.cache_full_block(parent, 7, block_pool.ROOT_CACHE_ID, (1, 1, 1, 1))
    assert pool.cache_full_block(child, 8, parent.cache_id, (2, 2, 2, 2))
    pool.free_blocks([parent])  # the child stays referenced
    (reused,) = pool.get_new_blocks(2)[1:]  # the free block, then the parent: evicted
    assert reused is parent and parent.block_hash is None
    assert pool.cache_full_block(reused, 7, block_pool.ROOT_CACHE_ID, (3, 3, 3, 3))
    assert pool.get_cached_block(7, block_pool.ROOT_CACHE_ID, (3, 3, 3, 3)) is reused
    assert pool.get_cached_block(8, reused.cache_id, (2, 2, 2, 2)) is None


def finished(kv, rid, tokens, task):
    """A turn of ``task`` run and freed: its full blocks are the task's remembered context."""
    request = req(rid, tokens, task=task)
    start(kv, request)
    kv.free(request)
    return request


def test_a_pin_that_leaves_less_than_the_reserve_is_refused_and_changes_nothing():
    kv = manager(6)
    finished(kv, "a1", range(9), "a")  # 2 full blocks
    finished(kv, "b1", range(100, 113), "b")  # 3 full blocks
    assert kv.pin("a", reserve_blocks=4) == 2  # 6 - 2 = 4 blocks stay out of pins
    before = kv.token_usage()
    with pytest.raises(PinRefused, match=r"'b': its 12 tokens would leave 4 of 24 KV tokens "
                                         r"out of pins, fewer than a request needs \(16\)"):
        kv.pin("b", reserve_blocks=4)
    assert kv.token_usage() == before and not kv.is_pinned("b") and kv.num_pins == 1
    assert kv.pin("b", reserve_blocks=1) == 3  # a smaller reserve: 1 block left
    assert kv.pin("a", reserve_blocks=6) == 2  # already pinned: unchanged, never refused


def test_at_most_one_pinned_task_per_block():
    kv = manager(3)
    assert [kv.pin(f"t{i}", reserve_blocks=1) for i in range(3)] == [0, 0, 0]  # no context yet
    with pytest.raises(PinRefused, match="3 tasks are pinned already, one per KV block"):
        kv.pin("t3")
    kv.unpin("t0")
    assert kv.pin("t3") == 0


def test_release_pin_drops_the_oldest_pin_first():
    kv = manager(8)
    finished(kv, "a1", range(5), "a")
    finished(kv, "b1", range(50, 55), "b")
    kv.pin("a")
    kv.pin("b")
    assert kv.release_pin() and not kv.is_pinned("a") and kv.is_pinned("b")
    assert kv.release_pin() and not kv.release_pin()
    assert kv.num_pins_released == 2 and kv.token_usage().num_pinned_tokens == 0


def test_forget_and_flush_free_the_per_task_state():
    kv = manager(10)
    for i in range(4):
        finished(kv, f"t{i}-0", range(10 * i, 10 * i + 5), f"t{i}")
    kv.pin("t0")
    assert kv.task_ids == {"t0", "t1", "t2", "t3"}
    kv.forget_task("t1")
    assert kv.task_ids == {"t0", "t2", "t3"}
    kv.flush()  # unpinned tasks' contexts go with the cached blocks; the pinned one stays
    assert kv.task_ids == {"t0"} and kv.token_usage().num_pinned_tokens == 4
    assert kv.pin("t2") == 0  # its context is forgotten: nothing to pin
    kv.forget_task("t0")
    kv.forget_task("t2")
    assert kv.task_ids == set() and kv.token_usage().num_pinned_tokens == 0


def test_remembered_contexts_are_bounded_by_the_block_count_oldest_dropped():
    kv = manager(4)
    for i in range(7):  # 7 distinct tasks, never forgotten
        finished(kv, f"t{i}-0", range(10 * i, 10 * i + 5), f"t{i}")
    assert kv.task_ids == {"t3", "t4", "t5", "t6"}  # max_task_contexts = 4 blocks
    finished(kv, "t3-1", range(30, 36), "t3")  # written again: now the newest
    finished(kv, "t7-0", range(70, 75), "t7")
    assert kv.task_ids == {"t3", "t5", "t6", "t7"}
