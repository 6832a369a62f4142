"""Block pool of the paged KV cache: fixed blocks, refcounts, prefix-cache index, LRU free queue.

Torch-free bookkeeping only: a block id indexes the KV tensors the model runner owns.

    free queue (LRU, head evicted first):  [b7 b3 | b9 b2 ...]   every block with ref_cnt == 0
                                             ^ least recently freed
    cached index:  block_hash -> block       full blocks whose content can be hit

A full block is identified by its *content*: its token ids and the content of its parent block.
Its hash chains to the parent's (``hash_block_tokens(parent_hash, token_ids)``) and is only an
index; a hit is confirmed by comparing the token ids and the parent's ``cache_id`` (a serial
number given to each distinct cached content), so a hash collision never returns wrong KV.

Invariant: a block is in the free queue iff its ref_cnt is 0, and the cached index maps each hash
to at most one block, whose ``block_hash`` is that hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROOT_HASH = 0  # parent hash of a sequence's first block
ROOT_CACHE_ID = 0  # parent cache_id of a sequence's first block


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained to its parent's hash (an index, checked on every hit)."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots; ``cache_id`` > 0 while it holds known content."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent_cache_id: int = ROOT_CACHE_ID
    cache_id: int = 0  # 0: no identified content; equal ids <=> equal token prefixes

    def reset_content(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.parent_cache_id = ROOT_CACHE_ID
        self.cache_id = 0


class BlockPool:
    """``num_blocks`` blocks, fixed at start; the pool never grows."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: expected a positive number, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[int, KVCacheBlock] = {}
        self._next_cache_id = ROOT_CACHE_ID + 1

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (free or cached-evictable): what an allocation can take."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Unreferenced blocks that can still be hit by a later request."""
        return sum(1 for b in self._free.values() if self._is_indexed(b))

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request or a pin, in [0, 1]."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next evicted) first."""
        return list(self._free)

    def get_cached_block(
        self, block_hash: int, parent_cache_id: int, token_ids: Sequence[int]
    ) -> KVCacheBlock | None:
        """The block holding exactly this content, or None (a hash match alone is not a hit)."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_cache_id != parent_cache_id:
            return None
        if block.token_ids != tuple(token_ids):
            return None
        return block

    # -- allocation ------------------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Take ``num_blocks`` from the free-queue head (evicting their cached content), or None."""
        if num_blocks > len(self._free):
            return None
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a hit or a pin); unreferenced ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference from each block; those reaching 0 join the queue tail in this order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    # -- prefix cache ----------------------------------------------------------------------------

    def cache_full_block(
        self, block: KVCacheBlock, block_hash: int, parent_cache_id: int, token_ids: Sequence[int]
    ) -> bool:
        """Give a just-filled block its content identity; False on a hash collision.

        A block whose content is already cached in another block (two requests computed the
        same prefix) takes that block's ``cache_id`` without replacing it in the index, so the
        children of either block chain correctly. After a collision the caller stops caching
        the rest of the sequence: the content below it cannot be identified by hash.
        """
        if not self.enable_caching:
            return False
        tokens = tuple(token_ids)
        existing = self._cached.get(block_hash)
        if existing is not None and existing is not block:
            if existing.parent_cache_id != parent_cache_id or existing.token_ids != tokens:
                return False  # collision: keep the first block, identify nothing below
            cache_id = existing.cache_id
        else:
            cache_id = self._next_cache_id
            self._next_cache_id += 1
            self._cached[block_hash] = block
        block.block_hash = block_hash
        block.token_ids = tokens
        block.parent_cache_id = parent_cache_id
        block.cache_id = cache_id
        return True

    def reindex(self, block: KVCacheBlock) -> None:
        """Index a block with identified content under its hash if no block holds that hash."""
        if block.block_hash is not None and block.block_hash not in self._cached:
            self._cached[block.block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached content (after a weight update the KV is stale); refs unchanged."""
        for block in self.blocks:
            block.reset_content()
        self._cached.clear()

    def _is_indexed(self, block: KVCacheBlock) -> bool:
        return block.block_hash is not None and self._cached.get(block.block_hash) is block

    def _evict(self, block: KVCacheBlock) -> None:
        if self._is_indexed(block):
            del self._cached[block.block_hash]
        block.reset_content()
