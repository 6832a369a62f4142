"""The two attention paths of the model: dense (training, reference) and paged (engine).

Paged KV cache layout (one tensor for the whole model)::

    kv_cache: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
                           ^ 0 = keys, 1 = values

Heads come before blocks: gathering a set of blocks for every head at once (one
``index_select``) yields each (KV head, sequence) pair's keys as one contiguous [L, head_dim]
matrix, the operand of a batched matmul, with no second copy to move the heads.

A *slot* is one token's place in the cache: ``slot = block_id * block_size + offset``. A
sequence's block table lists its block ids in order, so its token at position ``p`` lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``. Block id 0 is a valid
block: padding entries in a block table may hold any valid id (they are masked out).

A paged step takes the *new* tokens of several sequences packed into one flat batch (prefill
chunks and single decode tokens alike): sequence ``s`` owns rows
``query_start_loc[s]:query_start_loc[s + 1]``, and after this step's keys are written its
cache holds ``context_lens[s]`` tokens (cached + new). New tokens sit at the end of the context,
so the query at position ``p`` attends to cached positions ``0..p``.

Plain torch gather/scatter, no custom kernels: correct first, fast enough for tiny models.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PagedBatch:
    """Where one paged step's tokens go and what they attend to (all int64 tensors).

    - ``slot_mapping`` [num_tokens]: the cache slot each new token's key/value is written to.
    - ``block_tables`` [num_seqs, max_blocks]: each sequence's block ids (padding: any valid id).
    - ``context_lens`` [num_seqs]: tokens in each sequence's cache after this step.
    - ``query_start_loc`` [num_seqs + 1]: cumulative count of new tokens per sequence.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor

    @classmethod
    def build(cls, block_tables: list[list[int]], num_cached: list[int], num_new: list[int],
              block_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor,
                                                                              PagedBatch]:
        """Positions and batch for sequences that have ``num_cached[s]`` tokens in their blocks
        and add ``num_new[s]`` tokens (packed in sequence order). Block tables must already
        cover ``num_cached + num_new`` tokens; short ones are padded with their first block.
        """
        positions, slots = [], []
        for table, cached, new in zip(block_tables, num_cached, num_new, strict=True):
            if (cached + new + block_size - 1) // block_size > len(table):
                raise ValueError("block table too short for its sequence")
            for p in range(cached, cached + new):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        width = max(len(t) for t in block_tables)
        padded = [t + [t[0]] * (width - len(t)) for t in block_tables]
        starts = [0]
        for new in num_new:
            starts.append(starts[-1] + new)

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        lens = [c + n for c, n in zip(num_cached, num_new, strict=True)]
        return tensor(positions), cls(tensor(slots), tensor(padded), tensor(lens), tensor(starts))

    def select(self, seqs: torch.Tensor, rows: torch.Tensor, block_size: int) -> PagedBatch:
        """The batch of sequences ``seqs`` alone, whose new tokens are the packed ``rows``; its
        block tables cut to its own longest context."""
        context_lens = self.context_lens.index_select(0, seqs)
        width = -(-int(context_lens.max()) // block_size)
        counts = self.query_start_loc.diff().index_select(0, seqs)
        return PagedBatch(self.slot_mapping.index_select(0, rows),
                          self.block_tables.index_select(0, seqs)[:, :width], context_lens,
                          F.pad(counts.cumsum(0), (1, 0)))

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token (where its next-token logits are)."""
        return self.query_start_loc[1:] - 1


def new_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache in the layout above."""
    shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over whole sequences; q [B, H, T, D], k/v [B, Hkv, T, D] -> [B, H, T, D]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: list[int]) -> torch.Tensor:
    """Causal attention within each sequence of a packed row (no padding): sequence ``s`` owns
    rows ``cu_seqlens[s]:cu_seqlens[s + 1]`` and attends to its own rows only, the
    block-diagonal causal mask without building it. q [N, H, D], k/v [N, Hkv, D] -> [N, H, D].

    flash-attn's ``flash_attn_varlen_func`` runs it in one kernel on a GPU where it is
    installed; elsewhere each sequence is one ``scaled_dot_product_attention`` call (cost
    sum(L_s^2), not (sum L_s)^2), which on the CPU is exact and cheap for short sequences."""
    if q.is_cuda and _flash_varlen is not None and q.dtype in (torch.float16, torch.bfloat16):
        bounds = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in itertools.pairwise(cu_seqlens))
        return _flash_varlen(q, k, v, bounds, bounds, longest, longest, causal=True)
    gqa = q.shape[1] != k.shape[1]
    # 4-D [1, H, L, D]: with 3-D inputs SDPA falls back to its math kernel on the CPU, which
    # materialises the [H, L, L] weights (and keeps them for backward)
    out = [F.scaled_dot_product_attention(
        *(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
        is_causal=True, enable_gqa=gqa)[0].transpose(0, 1)
        for a, b in itertools.pairwise(cu_seqlens)]
    return torch.cat(out) if len(out) > 1 else out[0]


try:  # optional: flash-attn's varlen kernel (GPU)
    from flash_attn import flash_attn_varlen_func as _flash_varlen
except ImportError:
    _flash_varlen = None


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [num_tokens, Hkv, D] at their slots; ``layer_cache`` is
    ``kv_cache[layer]`` ([2, Hkv, num_blocks, block_size, D]), written in place."""
    num_kv_heads, head_dim = layer_cache.shape[1], layer_cache.shape[-1]
    flat = layer_cache.view(2, num_kv_heads, -1, head_dim)
    flat.index_copy_(2, slot_mapping, torch.stack((k, v)).transpose(1, 2).to(flat.dtype))


def paged_attention(q: torch.Tensor, layer_cache: torch.Tensor, positions: torch.Tensor,
                    batch: PagedBatch) -> torch.Tensor:
    """Attention of packed new tokens q [num_tokens, H, D] over their sequences' cached keys
    (this step's already written) -> [num_tokens, H, D].

    The sequences are padded into one [num_seqs, H, max_new, max_context] problem and run
    through one ``scaled_dot_product_attention`` call with an explicit mask.
    """
    num_tokens, num_heads, head_dim = q.shape
    seq_ids, rows = _token_rows(batch, num_tokens)
    max_new = int((batch.query_start_loc[1:] - batch.query_start_loc[:-1]).max())
    q_pad = q.new_zeros(batch.num_seqs, max_new, num_heads, head_dim)
    q_pad[seq_ids, rows] = q
    # Padding queries sit at position 0 so that no row of the mask is empty (no NaN).
    pos_pad = positions.new_zeros(batch.num_seqs, max_new)
    pos_pad[seq_ids, rows] = positions
    keys, values = gather_blocks(layer_cache, batch.block_tables).transpose(1, 2)
    max_context = int(batch.context_lens.max())
    keys, values = keys[:, :, :max_context], values[:, :, :max_context]  # [B, Hkv, L, D]
    key_pos = torch.arange(max_context, device=q.device)
    mask = key_pos.view(1, 1, -1) <= pos_pad.unsqueeze(-1)
    mask &= key_pos.view(1, 1, -1) < batch.context_lens.view(-1, 1, 1)
    groups = num_heads // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1).to(q.dtype)
    values = values.repeat_interleave(groups, dim=1).to(q.dtype)
    out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values,
                                         attn_mask=mask.unsqueeze(1))
    return out.transpose(1, 2)[seq_ids, rows]


def _token_rows(batch: PagedBatch, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed token: its sequence index and its row within that sequence's new tokens."""
    starts = batch.query_start_loc
    counts = starts[1:] - starts[:-1]
    seq_ids = torch.repeat_interleave(torch.arange(len(counts), device=starts.device), counts)
    rows = torch.arange(num_tokens, device=starts.device) - starts[seq_ids]
    return seq_ids, rows


def gather_blocks(layer_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[2, Hkv, num_seqs, max_blocks * block_size, D], contiguous: for each KV head, the blocks
    of each sequence's table in order, keys and values. One ``index_select`` over whole blocks
    (a block of one head is one contiguous row of the cache), several times faster on the CPU
    than advanced indexing."""
    num_seqs, max_blocks = block_tables.shape
    _, num_kv_heads, num_blocks, block_size, head_dim = layer_cache.shape
    rows = layer_cache.view(2 * num_kv_heads, num_blocks, -1).index_select(
        1, block_tables.reshape(-1))
    return rows.view(2, num_kv_heads, num_seqs, max_blocks * block_size, head_dim)


def gather_heads(layer_cache: torch.Tensor, block_tables: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each sequence's blocks, float32 [Hkv * num_seqs, L, D] (head-major:
    row ``h * num_seqs + s``), contiguous: the operands of one batched matmul per (KV head,
    sequence), straight from :func:`gather_blocks` (cast once if the cache is not float32)."""
    gathered = gather_blocks(layer_cache, block_tables).float()
    two, num_kv_heads, num_seqs, length, head_dim = gathered.shape
    out = gathered.view(two, num_kv_heads * num_seqs, length, head_dim)
    return out[0], out[1]
