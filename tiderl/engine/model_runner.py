"""The torch side of an engine step: SchedulerOutput in, sampled tokens and logprobs out.

    SchedulerOutput ──> flat input_ids / positions / slot_mapping, padded block tables
                    ──> ModelRunner._forward (one call: every prefill chunk and decode token;
                        the model's forward_paged with packed projections, docs/engine.md)
                    ──> logits of each sampling request's last token ──> Sampler
                    ──> ModelRunnerOutput {request_id: token}, {request_id: logprob}

The runner owns the paged KV cache tensor (``num_blocks`` x ``block_size`` slots, fixed for the
engine's life); the scheduler's block ids index it. Index tensors are built once per step from
plain lists; nothing loops over tokens in Python besides concatenating the scheduler's lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, pairwise

import torch
from torch import nn

from tiderl.engine.kernels import TorchKernels, kernels_for
from tiderl.engine.packed_linear import PackedLinears, gemm_rows
from tiderl.engine.sampler import Sampler
from tiderl.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from tiderl.models.attention import PagedBatch, paged_attention
from tiderl.models.qwen2 import Qwen2ForCausalLM, RMSNorm
from tiderl.models.qwen2_vl import Qwen2VLForCausalLM


class ModelRunner:
    def __init__(self, model: Qwen2ForCausalLM, num_blocks: int, block_size: int,
                 seed: int = 0, kernels: str = "auto") -> None:
        """``kernels``: ``engine.kernels`` (:func:`~tiderl.engine.kernels.kernels_for`)."""
        self.model = model.eval()
        self.block_size = block_size
        self.device = model.device
        self.kv_cache = model.new_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(seed)
        self.kernels = kernels_for(self.device, kernels)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, folded sin
        self.linears = PackedLinears(projection_groups(model))  # the GEMMs (packed_linear.py)
        # Each layer's modules, looked up once (nn.Module attribute lookups cost per step).
        self._layers = [_Layer(i, layer.input_layernorm, layer.self_attn.q_proj,
                               layer.self_attn.o_proj, layer.post_attention_layernorm,
                               layer.mlp.gate_proj, layer.mlp.down_proj)
                        for i, layer in enumerate(model.model.layers)]
        # The norm after each layer's residual add: the next layer's input norm, or the final.
        self._next_norms = [layer.input_norm for layer in self._layers[1:]] + [model.model.norm]
        attn = model.model.layers[0].self_attn
        self._heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        # Decode steps run every layer in one C++ call when the kernels are C++: the packed
        # weights in call order (rebuilt when PackedLinears repacks), each layer's two norms.
        self._one_call = not isinstance(self.kernels, TorchKernels)
        self._reads_images = isinstance(model, Qwen2VLForCausalLM)
        self._flat: tuple[dict, list[torch.Tensor], list[torch.Tensor | None]] | None = None
        self._norm_weights = [norm.weight for layer, after in zip(
            self._layers, self._next_norms, strict=True) for norm in (layer.post_norm, after)]

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if output.is_empty:
            return ModelRunnerOutput({}, {})
        items = output.scheduled
        input_ids, positions, batch = self._inputs(output)
        images = self._step_images(output) if self._reads_images else None
        sampling = [i for i, item in enumerate(items) if item.samples]
        if len(input_ids) == len(items):  # every request decodes one token
            logits = self._forward(input_ids, positions, batch, None, images)
        else:  # prefill chunks (maybe with decodes): logits of the sampling rows only
            rows = batch.query_start_loc[1:] - 1
            if len(sampling) < len(items):
                rows = rows[torch.tensor(sampling or [0], device=self.device)]
            logits = self._forward(input_ids, positions, batch, rows, images)
        if not sampling:  # only prefill chunks this step: their KV is written, nothing sampled
            return ModelRunnerOutput({}, {})
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

    def _step_images(self, output: SchedulerOutput) -> _StepImages:
        """A model that reads images: the step's rotary positions (multimodal: [3, T], each
        request's from :meth:`PromptImages.rope_positions
        <tiderl.engine.multimodal.PromptImages.rope_positions>`) as rows of rotary tables, and
        the image embeddings that replace the token embeddings of its image-pad rows."""
        parts, rows, values, at = [], [], [], 0
        for item in output.scheduled:
            start, count = item.num_computed_tokens, len(item.token_ids)
            if item.images is None:
                parts.append(torch.tensor(item.positions).expand(3, -1))
            else:
                parts.append(item.images.rope_positions(start, start + count))
                for offset, embeds in item.images.embed_rows(start, start + count):
                    rows.append(torch.arange(at + offset, at + offset + len(embeds)))
                    values.append(embeds)
            at += count
        rope = torch.cat(parts, dim=1).to(self.device)
        if torch.equal(rope[0], rope[1]) and torch.equal(rope[0], rope[2]):
            index = rope[0].contiguous()  # text only: plain rotary at these positions
            cos, sin = self._rotary_tables(index)
        else:
            index = torch.arange(rope.shape[1], device=self.device)
            cos, sin = self._mrope_rows(rope)
        if not rows:
            return _StepImages(index, cos, sin, None, None)
        return _StepImages(index, cos, sin, torch.cat(rows).to(self.device),
                           torch.cat(values).to(self.model.dtype))

    def _mrope_rows(self, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [T, D] of multimodal positions [3, T]: frequency pair j
        turns with the component its ``mrope_section`` gives it (as
        :class:`~tiderl.models.qwen2_vl.MRotary`)."""
        rotary = self.model.model.rotary
        dim = rotary.head_dim
        inv_freq = 1.0 / (rotary.theta ** (
            torch.arange(0, dim, 2, device=self.device).float() / dim))
        component = torch.repeat_interleave(torch.arange(3, device=self.device),
                                            torch.tensor(rotary.mrope_section,
                                                         device=self.device))
        freqs = rope.t().float()[:, component] * inv_freq  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        folded = angles.sin()
        folded[:, :dim // 2].neg_()
        return angles.cos().to(self.model.dtype), folded.to(self.model.dtype)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                 logits_rows: torch.Tensor | None, images: _StepImages | None = None
                 ) -> torch.Tensor:
        """The paged forward (:meth:`Qwen2ForCausalLM.forward_paged`, same weights, equal to
        float rounding; tests: 1e-5) with less work per layer:

        - four GEMMs a layer through :class:`PackedLinears` (q/k/v stacked, o, gate/up stacked,
          down; oneDNN with reordered weights on the CPU, 2-2.5x ``F.linear`` for decode rows
          and for prefill chunks alike);
        - the rest in four in-place calls of :mod:`~tiderl.engine.kernels` (C++ on the CPU):
          residual add with the next norm, SiLU-and-multiply, q and k rotated with k and v
          written to the cache (positions looked up in tables kept across steps), and the
          decode attention read from the paged cache;
        - attention in two parts (:meth:`_parts`): the sequences with one new token through
          ``paged_decode_attention``, those with more through :func:`paged_attention`;
        - a decode step with the C++ kernels runs the whole layer loop as one C++ call
          (:meth:`_decode_layers`);
        - the lm_head only on ``logits_rows`` (None: every row).

        ``images`` (a model that reads images): the rotary rows of each token (else its
        position's) and the image embeddings put in place of the pad tokens' embeddings."""
        linear, kernels, (heads, kv_heads, dim) = self.linears, self.kernels, self._heads
        linear.refresh()
        num_tokens = len(input_ids)
        if images is None:
            rope = positions
            cos, sin = self._rotary_tables(positions)
        else:
            rope, cos, sin = images.rope_index, images.cos, images.sin
        parts = self._parts(positions, batch)

        def attend(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
            qkv = linear(layer.qkv, x)  # [T, (H + 2 Hkv) D]: q, k, v side by side
            cache = self.kv_cache[layer.index]
            kernels.rotary_write_kv(qkv, rope, cos, sin, cache, batch.slot_mapping,
                                    heads, kv_heads)
            q = qkv[:, :heads * dim].view(num_tokens, heads, dim)
            if len(parts) == 1:
                out = self._attention(parts[0], q, cache)
            else:
                out = torch.empty_like(q)
                for part in parts:
                    out.index_copy_(0, part.rows, self._attention(
                        part, q.index_select(0, part.rows), cache))
            return linear(layer.o, out.view(num_tokens, heads * dim))

        residual = self.model.model.embed_tokens(input_ids)
        if images is not None and images.embed_rows is not None:
            residual.index_copy_(0, images.embed_rows, images.embed_values)
        x = residual.clone()
        norm = self._layers[0].input_norm
        kernels.add_rms_norm(x, None, norm.weight, norm.eps)
        if self._one_call and len(parts) == 1 and parts[0].decode:
            x = self._decode_layers(x, residual, rope, cos, sin, batch)
            return linear(self.model.lm_head, x)
        for layer, norm in zip(self._layers, self._next_norms, strict=True):
            x = attend(layer, x)  # DecoderLayer._forward, with the packed projections
            post = layer.post_norm
            kernels.add_rms_norm(x, residual, post.weight, post.eps)  # residual += x; x = norm
            gate_up = linear(layer.gate_up, x)
            x = gate_up.new_empty((num_tokens, gate_up.shape[1] // 2))
            kernels.silu_and_mul(x, gate_up)
            x = linear(layer.down, x)
            kernels.add_rms_norm(x, residual, norm.weight, norm.eps)  # next layer's, or final
        if logits_rows is not None:
            x = x[logits_rows]
        return linear(self.model.lm_head, x)

    def _decode_layers(self, x: torch.Tensor, residual: torch.Tensor, rope: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """The layer loop of :meth:`_forward` for a decode step, as one call of the C++
        ``decode_layers`` (the same projections, on rows padded as :class:`PackedLinears`
        pads them, and kernels, no Python between them: batch-32 steps of 1.14 -> 0.99 ms on
        the tiny model, 5.96 -> 5.51 ms on the small one)."""
        packed = self.linears.packed
        if self._flat is None or self._flat[0] is not packed:  # repacked since: new copies
            pairs = [packed[m] for layer in self._layers
                     for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            self._flat = (packed, [w for w, _ in pairs], [b for _, b in pairs])
        _, weights, biases = self._flat
        heads, kv_heads, _ = self._heads
        return self.kernels.decode_layers(
            x, residual, weights, biases, self._norm_weights, self.kv_cache, rope, cos, sin,
            batch.slot_mapping, batch.block_tables, batch.context_lens, heads, kv_heads,
            self._layers[0].post_norm.eps, self.linears.enabled, gemm_rows(len(x)))

    def _parts(self, positions: torch.Tensor, batch: PagedBatch) -> list[_Part]:
        """The step's attention problems: the sequences that decode one token as one, and those
        with a prefill chunk as one more, or one each when padding them together would more
        than double their work (:func:`padding_pays`). Apart, a mixed step costs what its
        halves cost: padded into one problem, each decode row would be padded to the longest
        chunk (one 40-token chunk joining 16 decoding sequences of the small model made a
        5.9 ms step 39 ms). Each part's block tables are cut to its own longest context."""
        starts = batch.query_start_loc.tolist()
        counts = [b - a for a, b in pairwise(starts)]
        decode = [s for s, n in enumerate(counts) if n == 1]
        prefill = [s for s, n in enumerate(counts) if n > 1]
        if not prefill:
            return [self._part(positions, batch, decode=True)]
        context = batch.context_lens.tolist()
        together = padding_pays([counts[s] for s in prefill], [context[s] for s in prefill])
        if together and not decode:  # the whole batch, as it is
            return [self._part(positions, batch, decode=False)]

        def part(seqs: list[int], is_decode: bool) -> _Part:
            rows = chain.from_iterable(range(starts[s], starts[s + 1]) for s in seqs)
            return self._part(positions, batch, is_decode, *(
                torch.tensor(list(ids), device=self.device) for ids in (seqs, rows)))

        groups = [prefill] if together else [[s] for s in prefill]
        return ([part(decode, True)] if decode else []) + [part(g, False) for g in groups]

    def _part(self, positions: torch.Tensor, batch: PagedBatch, decode: bool,
              seqs: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> _Part:
        """The attention problem of the batch's sequences ``seqs`` (None: all of them), whose new
        tokens are the packed ``rows``; ``decode``: each has one new token."""
        if seqs is not None:
            batch = batch.select(seqs, rows, self.block_size)
            positions = positions.index_select(0, rows)
        return _Part(rows, positions, batch, decode)

    def _attention(self, part: _Part, q: torch.Tensor, layer_cache: torch.Tensor
                   ) -> torch.Tensor:
        if not part.decode:
            return paged_attention(q, layer_cache, part.positions, part.batch)
        out = q.new_empty(q.shape)
        self.kernels.paged_decode_attention(out, q, layer_cache, part.batch.block_tables,
                                            part.batch.context_lens, self._heads[2] ** -0.5)
        return out

    def _rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [P, D] (the model's dtype) for positions up to twice the
        largest seen (rebuilt only then): ``rotate_half(x) * sin`` is
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
        return self._rope

    def reset_kv_cache(self) -> None:
        """Zero the cache (not needed for correctness: stale slots are never attended)."""
        self.kv_cache.zero_()


@dataclass(frozen=True, slots=True)
class _StepImages:
    """A step of a model that reads images: each token's row of the rotary tables ``cos`` and
    ``sin``, and the rows whose embeddings are image embeddings (None: no image this step)."""

    rope_index: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    embed_rows: torch.Tensor | None
    embed_values: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _Part:
    """One attention problem of a step: the packed ``rows`` of its sequences' new tokens (None:
    every row), their positions and batch; ``decode``: each of its sequences has one new token."""

    rows: torch.Tensor | None
    positions: torch.Tensor
    batch: PagedBatch
    decode: bool


@dataclass(frozen=True, slots=True)
class _Layer:
    """A decoder layer's modules as :meth:`ModelRunner._forward` uses them; ``qkv`` and
    ``gate_up`` are the first members of their :class:`PackedLinears` groups."""

    index: int
    input_norm: RMSNorm
    qkv: nn.Linear
    o: nn.Linear
    post_norm: RMSNorm
    gate_up: nn.Linear
    down: nn.Linear


def padding_pays(new_tokens: list[int], context_lens: list[int]) -> bool:
    """Whether prefill chunks should share one padded attention problem: its work (sequences x
    longest chunk x longest context) at most twice the work of one problem per sequence, which
    costs a call each (small model on 2 threads: 32 equal 33-token prompts 2.7 ms padded, 6.9 ms
    one by one; a 300-token prompt with seven 30-token turns on 250 cached tokens 11.4 ms
    padded, 4.0 ms one by one)."""
    padded = len(new_tokens) * max(new_tokens) * max(context_lens)
    return padded <= 2 * sum(n * c for n, c in zip(new_tokens, context_lens, strict=True))


def projection_groups(model: Qwen2ForCausalLM) -> list[tuple[nn.Linear, ...]]:
    """The linears a step runs, grouped by shared input: per layer q/k/v, o, gate/up,
    down; then the lm_head."""
    groups = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [(attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,),
                   (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
    return [*groups, (model.lm_head,)]
