"""Per-request view of the block pool: block tables, prefix-cache hits, task pins.

    request blocks:  [ full | full | full | partial ]    block_ids = the request's block table
                      <-- identified (hit-able) -->      num_cached_blocks of them
    task pin:        one extra reference on the task's latest identified blocks

A request's blocks are freed in reverse order, so under pressure its tail is evicted before its
prefix. A pin is a reference held by the task itself: pinned blocks survive with no request of
the task running, and move to the task's newest context whenever one of its requests is freed.

Per-task state is bounded: a task's remembered context (what a pin looks up) is kept for at
most ``num_blocks`` tasks, least recently written dropped first; ``forget_task`` (the task ended)
drops it and the pin, ``flush`` drops every unpinned task's. A pin is refused
(:class:`PinRefused`) when it would leave fewer blocks out of pins than the caller reserves for
one request, or when there are as many pinned tasks as blocks.

Invariant: every block's ref_cnt equals the number of running requests whose block table holds
it plus the number of task pins that hold it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.core.quote import short
from tiderl.core.types import ImageRef
from tiderl.engine import block_pool
from tiderl.engine.block_pool import ROOT_CACHE_ID, ROOT_HASH, BlockPool, KVCacheBlock
from tiderl.engine.config import EngineConfig
from tiderl.engine.request import Request

_Content = tuple[int, tuple]  # (block hash, content key: token ids [+ image keys]) of a full block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PinRefused(Exception):
    """A pin that would leave no room for a request (the HTTP server answers 409): the task
    goes on unpinned."""


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """KV pool occupancy in tokens (whole blocks). ``used`` = referenced by a request or a pin."""

    num_total_tokens: int
    num_used_tokens: int
    num_pinned_tokens: int  # of used: held by task pins
    num_cached_tokens: int  # unreferenced but still hit-able (evicted first-freed-first)
    num_free_tokens: int  # unreferenced (cached ones included): what allocation can take


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: expected a positive number, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_hashes: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._task_context: OrderedDict[str, list[_Content]] = OrderedDict()  # latest freed
        # context per task, least recently written first; at most max_task_contexts of them
        self.max_task_contexts = num_blocks
        self._pins: dict[str, list[KVCacheBlock]] = {}  # oldest pin first
        self.num_prefix_cache_queries = 0  # tokens looked up (prompt of each scheduled request)
        self.num_prefix_cache_hits = 0  # of those, tokens found in the cache
        self.num_pins = 0  # pins taken (a task's context held between its turns)
        self.num_pins_released = 0  # pins dropped so that a request could fit (see release_pin)

    @classmethod
    def from_config(cls, config: EngineConfig) -> KVCacheManager:
        """``kv_cache_tokens // block_size`` blocks, fixed for the engine's life."""
        return cls(config.kv_cache_tokens // config.block_size, config.block_size,
                   config.enable_prefix_caching)

    # -- prefix-cache lookup ---------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks (and its token count); counts nothing.

        At most ``(num_tokens - 1) // block_size`` blocks, so at least one token is computed
        and the step can sample.
        """
        if not self.enable_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        parent_id = ROOT_CACHE_ID
        for i, block_hash in enumerate(hashes[:max_blocks]):
            tokens = self._block_tokens(request, i)
            block = self.pool.get_cached_block(block_hash, parent_id, tokens)
            if block is None:
                break
            hit.append(block)
            parent_id = block.cache_id
        return hit, len(hit) * self.block_size

    # -- allocation ------------------------------------------------------------------------------

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free-queue blocks an allocation takes: new blocks plus unreferenced hit blocks."""
        held = len(self._req_blocks.get(request.request_id, ()))
        num_tokens = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                      + num_new_tokens)
        num_new = max(0, cdiv(num_tokens, self.block_size) - held - len(new_computed_blocks))
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def can_allocate(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        needed = self.num_blocks_needed(request, num_new_tokens, new_computed_blocks or [])
        return needed <= self.pool.num_free_blocks

    def allocate(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Slots for ``num_new_tokens`` more tokens after the computed (and hit) ones, or None.

        ``new_computed_blocks`` are the request's prefix-cache hits (first allocation only);
        they are referenced and prepended. Returns the newly taken blocks (maybe []); on None
        nothing changed. The first allocation of a request counts a prefix-cache query.
        """
        computed = new_computed_blocks or []
        rid = request.request_id
        held = self._req_blocks.get(rid)
        if not computed and held and (cdiv(request.num_computed_tokens + num_new_tokens,
                                           self.block_size) <= len(held)):
            return []  # the blocks it holds have room (15 of 16 decode steps)
        if not self.can_allocate(request, num_new_tokens, computed):
            return None
        blocks = self._req_blocks.setdefault(rid, [])
        if computed:
            if blocks or request.num_computed_tokens:
                raise ValueError(f"request {rid}: prefix hits after its first allocation")
            self.pool.touch(computed)
            blocks.extend(computed)
            self._num_cached_blocks[rid] = len(computed)
        if request.num_computed_tokens == 0 and len(blocks) == len(computed):
            self.num_prefix_cache_queries += request.num_tokens
            self.num_prefix_cache_hits += len(computed) * self.block_size
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        new_blocks = self.pool.get_new_blocks(cdiv(num_tokens, self.block_size) - len(blocks))
        assert new_blocks is not None  # can_allocate checked the free queue
        blocks.extend(new_blocks)
        request.block_ids.extend(b.block_id for b in (*computed, *new_blocks))
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Identify the request's blocks now full of computed tokens (call after each step)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self._req_blocks.get(rid, [])
        start = self._num_cached_blocks.get(rid, 0)
        end = min(request.num_computed_tokens // self.block_size, len(blocks))
        if start < 0 or start >= end:
            return  # a collision stopped caching for this request, or no block newly full
        hashes = self._block_hashes(request)
        for i in range(start, end):
            parent_id = ROOT_CACHE_ID if i == 0 else blocks[i - 1].cache_id
            if i > 0 and parent_id == ROOT_CACHE_ID:  # parent content forgotten (cache reset)
                self._num_cached_blocks[rid] = -1
                return
            tokens = self._block_tokens(request, i)
            if not self.pool.cache_full_block(blocks[i], hashes[i], parent_id, tokens):
                self._num_cached_blocks[rid] = -1
                return
        self._num_cached_blocks[rid] = max(start, end)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first; a pinned task's pin moves to its context."""
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, [])
        num_cached = max(0, self._num_cached_blocks.pop(rid, 0))
        self._req_hashes.pop(rid, None)
        context: list[_Content] = []
        for block in blocks[:num_cached]:
            if block.block_hash is None or block.token_ids is None:
                break  # content forgotten by a cache reset
            self.pool.reindex(block)  # a duplicate stands in for an evicted original
            context.append((block.block_hash, block.token_ids))
        if context:
            self._remember(request.task_id, context)
        if request.task_id in self._pins and context:
            pinned = self._lookup_task_context(request.task_id)
            self.pool.touch(pinned)  # before releasing the old pin: shared blocks stay held
            self._release_pin(request.task_id)
            self._pins[request.task_id] = pinned
        self.pool.free_blocks(reversed(blocks))
        request.block_ids.clear()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, task_id: str, reserve_blocks: int = 0) -> int:
        """Hold the task's latest context (its still-cached prefix); returns the pinned blocks.

        Refused (:class:`PinRefused`, nothing changed) when fewer than ``reserve_blocks``
        blocks would stay out of pins, or when every block already has a pinned task. Pinning
        a pinned task returns its pin unchanged."""
        if task_id in self._pins:
            return len(self._pins[task_id])
        num_blocks = self.pool.num_blocks
        if len(self._pins) >= num_blocks:
            raise PinRefused(f"pin {short(task_id)}: {len(self._pins)} tasks are pinned already, "
                             f"one per KV block")
        blocks = self._lookup_task_context(task_id)
        num_left = num_blocks - len(self.pinned_block_ids() | {b.block_id for b in blocks})
        if num_left < reserve_blocks:
            bs = self.block_size
            raise PinRefused(f"pin {short(task_id)}: its {len(blocks) * bs} tokens would leave "
                             f"{num_left * bs} of {num_blocks * bs} KV tokens out of pins, "
                             f"fewer than a request needs ({reserve_blocks * bs})")
        self._pins[task_id] = blocks
        self.pool.touch(blocks)
        self.num_pins += 1
        return len(blocks)

    def unpin(self, task_id: str) -> None:
        """Drop the task's pin: unless a request holds them, its blocks become evictable."""
        if task_id in self._pins:
            self._release_pin(task_id)
            del self._pins[task_id]

    def release_pin(self) -> bool:
        """Drop the oldest pin (a request that can never fit beside the pins needs its
        blocks); False when there is none."""
        if not self._pins:
            return False
        self.unpin(next(iter(self._pins)))
        self.num_pins_released += 1
        return True

    def forget_task(self, task_id: str) -> None:
        """The task ended: unpin it and drop its remembered context."""
        self.unpin(task_id)
        self._task_context.pop(task_id, None)

    def flush(self) -> None:
        """Forget every unreferenced block's content and every unpinned task's context."""
        self.evict_unreferenced()
        for task_id in [t for t in self._task_context if t not in self._pins]:
            del self._task_context[task_id]

    @property
    def task_ids(self) -> set[str]:
        """Tasks with state here (a remembered context or a pin)."""
        return set(self._task_context) | set(self._pins)

    def pinned_block_ids(self) -> set[int]:
        return {b.block_id for blocks in self._pins.values() for b in blocks}

    def is_pinned(self, task_id: str) -> bool:
        return task_id in self._pins

    # -- usage -----------------------------------------------------------------------------------

    @property
    def kv_cache_usage_perc(self) -> float:
        """Fraction (0..1, as vLLM's gauge of this name) of blocks referenced."""
        return self.pool.usage

    def token_usage(self) -> TokenUsage:
        bs = self.block_size
        num_free = self.pool.num_free_blocks
        pinned = self.pinned_block_ids()
        return TokenUsage(
            num_total_tokens=self.pool.num_blocks * bs,
            num_used_tokens=(self.pool.num_blocks - num_free) * bs,
            num_pinned_tokens=len(pinned) * bs,
            num_cached_tokens=self.pool.num_cached_free_blocks * bs,
            num_free_tokens=num_free * bs,
        )

    def reset_prefix_cache(self) -> None:
        """After a weight update: no cached KV may be hit again (held blocks stay allocated)."""
        self.pool.reset_prefix_cache()
        self._task_context.clear()

    def drop_all(self) -> None:
        """The engine goes to sleep (no request holds a block): every pin, remembered task
        context and cached block content is dropped."""
        for task_id in list(self._pins):
            self.unpin(task_id)
        self.reset_prefix_cache()
        self.evict_unreferenced()

    def evict_unreferenced(self) -> None:
        """Forget the content of every unreferenced block (a flush): blocks held by a request
        or a pin stay hit-able."""
        blocks = self.pool.get_new_blocks(self.pool.num_free_blocks)  # evicts their content
        assert blocks is not None
        self.pool.free_blocks(blocks)

    # -- helpers ---------------------------------------------------------------------------------

    def _block_tokens(self, request: Request, i: int) -> tuple:
        """Block ``i``'s content key: its token ids, then the hash of each image among them
        (equal pad tokens of different pictures must not hit each other)."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        tokens = tuple(request.all_token_ids[start:end])
        if request.images is None:
            return tokens
        return tokens + block_image_keys(request.images.refs, start, end)

    def _block_hashes(self, request: Request) -> list[int]:
        """Chained hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        for i in range(len(hashes), request.num_tokens // self.block_size):
            parent = hashes[i - 1] if i else ROOT_HASH
            hashes.append(block_pool.hash_block_tokens(parent, self._block_tokens(request, i)))
        return hashes

    def _remember(self, task_id: str, context: list[_Content]) -> None:
        self._task_context[task_id] = context
        self._task_context.move_to_end(task_id)
        while len(self._task_context) > self.max_task_contexts:
            self._task_context.popitem(last=False)

    def _lookup_task_context(self, task_id: str) -> list[KVCacheBlock]:
        found: list[KVCacheBlock] = []
        parent_id = ROOT_CACHE_ID
        for block_hash, tokens in self._task_context.get(task_id, ()):
            block = self.pool.get_cached_block(block_hash, parent_id, tokens)
            if block is None:
                break
            found.append(block)
            parent_id = block.cache_id
        return found

    def _release_pin(self, task_id: str) -> None:
        self.pool.free_blocks(reversed(self._pins[task_id]))


def block_image_keys(refs: Sequence[ImageRef], start: int, end: int
                     ) -> tuple[tuple[str, int], ...]:
    """The images overlapping sequence indices start..end-1 (one KV block): (hash, the
    image's offset relative to ``start``) each, for the block's prefix-cache key."""
    return tuple((ref.key, ref.offset - start) for ref in refs
                 if ref.offset < end and ref.offset + ref.num_tokens > start)
