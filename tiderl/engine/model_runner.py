"""The torch side of an engine step: SchedulerOutput in, sampled tokens and logprobs out.

    SchedulerOutput ──> flat input_ids / positions / slot_mapping, padded block tables
                    ──> model.forward_paged (one call: every prefill chunk and decode token)
                    ──> logits of each sampling request's last token ──> Sampler
                    ──> ModelRunnerOutput {request_id: token}, {request_id: logprob}

The runner owns the paged KV cache tensor (``num_blocks`` x ``block_size`` slots, fixed for the
engine's life); the scheduler's block ids index it. Index tensors are built once per step from
plain lists; nothing loops over tokens in Python besides concatenating the scheduler's lists.
"""

from __future__ import annotations

from itertools import chain

import torch
import torch.nn.functional as F

from tiderl.engine.packed_linear import PackedLinears
from tiderl.engine.sampler import Sampler
from tiderl.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from tiderl.models.attention import PagedBatch, gather_blocks, write_kv
from tiderl.models.qwen2 import Qwen2ForCausalLM


class ModelRunner:
    def __init__(self, model: Qwen2ForCausalLM, num_blocks: int, block_size: int,
                 seed: int = 0) -> None:
        self.model = model.eval()
        self.block_size = block_size
        self.device = model.device
        self.kv_cache = model.new_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(seed)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, folded sin
        self.linears = PackedLinears(model)  # decode GEMMs (packed_linear.py)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if output.is_empty:
            return ModelRunnerOutput({}, {})
        items = output.scheduled
        input_ids, positions, batch = self._inputs(output)
        sampling = [i for i, item in enumerate(items) if item.samples]
        if not sampling:  # only prefill chunks this step: write their KV, sample nothing
            self.model.forward_paged(input_ids, positions, self.kv_cache, batch,
                                     logits_indices=batch.query_start_loc[:1])
            return ModelRunnerOutput({}, {})
        if len(input_ids) == len(items):  # every request decodes one token
            logits = self._decode_forward(input_ids, positions, batch)
        else:
            rows = batch.query_start_loc[1:] - 1
            if len(sampling) < len(items):
                rows = rows[torch.tensor(sampling, device=self.device)]
            logits = self.model.forward_paged(input_ids, positions, self.kv_cache, batch,
                                              logits_indices=rows)
        chosen = [items[i] for i in sampling]
        tokens, logprobs = self.sampler(logits, [c.sampling for c in chosen],
                                        [c.num_output_tokens for c in chosen])
        ids = [c.request_id for c in chosen]
        return ModelRunnerOutput(dict(zip(ids, tokens.tolist(), strict=True)),
                                 dict(zip(ids, logprobs.tolist(), strict=True)))

    def _inputs(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
        items = output.scheduled
        num_new = [len(item.token_ids) for item in items]
        width = max(len(item.block_table) for item in items)
        tables = [item.block_table + [item.block_table[0]] * (width - len(item.block_table))
                  for item in items]
        starts = [0]
        for n in num_new:
            starts.append(starts[-1] + n)

        def tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        batch = PagedBatch(
            slot_mapping=tensor(list(chain.from_iterable(i.slot_mapping for i in items))),
            block_tables=tensor(tables),
            context_lens=tensor([i.num_computed_tokens + n
                                 for i, n in zip(items, num_new, strict=True)]),
            query_start_loc=tensor(starts),
        )
        input_ids = tensor(list(chain.from_iterable(i.token_ids for i in items)))
        positions = tensor(list(chain.from_iterable(i.positions for i in items)))
        return input_ids, positions, batch

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        batch: PagedBatch) -> torch.Tensor:
        """The paged forward for a step of single-token sequences, with less per-layer work
        than :func:`~tiderl.models.attention.paged_attention`: the projections through
        :class:`PackedLinears` (oneDNN, reordered weights, the gate's SiLU fused), rotary rows
        looked up in a table kept across steps (same formula as
        :class:`~tiderl.models.qwen2.Rotary`), each sequence's blocks gathered by one
        ``index_select``, and one ``scaled_dot_product_attention`` with the query heads of a KV
        head as its queries (grouped-query attention without repeating keys, no query padding,
        no causal mask). Same weights; equal to the generic path to float rounding (tests:
        1e-5)."""
        cos, sin = self._rotary_rows(positions)
        block_tables, slots = batch.block_tables, batch.slot_mapping
        num_seqs, width = block_tables.shape
        key_pos = torch.arange(width * self.block_size, device=self.device)
        valid = (key_pos < batch.context_lens.unsqueeze(-1)).view(num_seqs, 1, 1, -1)
        bias = torch.zeros(valid.shape, dtype=self.model.dtype, device=self.device)
        bias.masked_fill_(~valid, float("-inf"))

        def rotate(x: torch.Tensor) -> torch.Tensor:  # x * cos + rotate_half(x) * sin
            swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
            return torch.addcmul(x * cos, swapped, sin)

        def attend(attn, x: torch.Tensor) -> torch.Tensor:
            heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
            q = rotate(linear(attn.q_proj, x).view(num_seqs, kv_heads, heads // kv_heads, dim))
            k = rotate(linear(attn.k_proj, x).view(num_seqs, kv_heads, 1, dim))
            v = linear(attn.v_proj, x).view(num_seqs, kv_heads, dim)
            layer = self.kv_cache[attn.layer]
            write_kv(layer, k.view(num_seqs, kv_heads, dim), v, slots)
            context = gather_blocks(layer, block_tables).transpose(2, 3)  # [2, B, Hkv, L, D]
            out = F.scaled_dot_product_attention(q, context[0].to(q.dtype),
                                                 context[1].to(q.dtype), attn_mask=bias)
            return linear(attn.o_proj, out.reshape(num_seqs, heads * dim))

        model, linear = self.model.model, self.linears
        linear.refresh()
        x = model.embed_tokens(input_ids)
        for layer in model.layers:  # DecoderLayer._forward, with the packed projections
            x = x + attend(layer.self_attn, layer.input_layernorm(x))
            h, mlp = layer.post_attention_layernorm(x), layer.mlp
            x = x + linear(mlp.down_proj, linear(mlp.gate_proj, h, "silu") * linear(mlp.up_proj, h))
        return linear(self.model.lm_head, model.norm(x))

    def _rotary_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [B, 1, 1, D] of each position, from tables grown to twice the
        largest position seen (rebuilt only then): ``rotate_half(x) * sin`` is
        ``swap_halves(x) * sin_folded`` with the first half of ``sin_folded`` negated."""
        needed = int(positions.max()) + 1
        if self._rope is None or self._rope[0].shape[0] < needed:
            rotary = self.model.model.rotary
            exponents = torch.arange(0, rotary.head_dim, 2, device=self.device).float()
            inv_freq = 1.0 / (rotary.theta ** (exponents / rotary.head_dim))
            freqs = torch.arange(2 * needed, device=self.device).float().unsqueeze(-1) * inv_freq
            angles = torch.cat((freqs, freqs), dim=-1)
            folded = angles.sin()
            folded[:, :rotary.head_dim // 2].neg_()
            self._rope = (angles.cos().to(self.model.dtype), folded.to(self.model.dtype))
        cos, sin = self._rope
        shape = (len(positions), 1, 1, -1)
        return (cos.index_select(0, positions).view(shape),
                sin.index_select(0, positions).view(shape))

    def reset_kv_cache(self) -> None:
        """Zero the cache (not needed for correctness: stale slots are never attended)."""
        self.kv_cache.zero_()
