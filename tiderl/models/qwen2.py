"""A Qwen2-architecture decoder in plain PyTorch, shared by the engine and the trainer.

RMSNorm, rotary position embeddings (``rope_theta``), grouped-query attention with bias on the
q/k/v projections, SwiGLU MLP, tied or untied embeddings. Parameter names are the Hugging Face
ones (``model.layers.N.self_attn.q_proj.weight`` ...), so a Qwen2 / Qwen2.5 checkpoint's state
dict loads as is. The numerics follow transformers' ``Qwen2ForCausalLM`` (norms in float32,
rotary tables in float32 cast to the activation dtype).

Three forward paths share every weight:

- :meth:`Qwen2ForCausalLM.forward`: dense, whole sequences [batch, seq], causal (tests, the
  reference for the others);
- the same method with ``cu_seqlens``: sequences packed into one row without padding, each
  attending to itself only; with ``targets`` it returns only the log-probabilities of those
  next tokens, computed a chunk of rows at a time (the trainer: :func:`packed_token_logprobs`);
- :meth:`Qwen2ForCausalLM.forward_paged`: packed new tokens of many sequences over a paged KV
  cache (the engine: chunked prefill and batched decode); layout in :mod:`.attention`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tiderl.models.attention import (
    PagedBatch,
    dense_attention,
    new_kv_cache,
    paged_attention,
    varlen_attention,
    write_kv,
)

if TYPE_CHECKING:
    from tiderl.models.image_rows import BatchImages

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Qwen2Config:
    """Architecture hyperparameters (the subset of HF ``config.json`` the model uses)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # one, or several (generation ends)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> Qwen2Config:
        """Read an HF ``config.json`` dict (legacy and transformers-5 spellings)."""
        if data.get("model_type", "qwen2") != "qwen2":
            raise ValueError(f"unsupported model_type {data['model_type']!r}: the embedded "
                             "engine and the trainer build Qwen2 and Qwen2-VL (docs/models.md)")
        return cls(**text_fields(data))

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers reads as a ``Qwen2Config``."""
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "hidden_act": "silu", "attention_dropout": 0.0, "use_sliding_window": False,
                "use_cache": True, "initializer_range": 0.02, **asdict(self)}


def text_fields(data: dict[str, Any], rope_types: tuple[str, ...] = ("default",)
                ) -> dict[str, Any]:
    """The :class:`Qwen2Config` fields of an HF config dict (legacy and transformers-5
    spellings); a ValueError for what the model does not build: a rope type outside
    ``rope_types``, sliding-window attention, a head_dim other than hidden / heads."""
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in (*rope_types, None):
        raise ValueError(f"unsupported rope scaling {rope!r}")
    if data.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    head_dim = data.get("head_dim")
    if head_dim not in (None, data["hidden_size"] // data["num_attention_heads"]):
        raise ValueError(f"unsupported head_dim {head_dim}")
    eos = data.get("eos_token_id")
    return dict(
        vocab_size=data["vocab_size"], hidden_size=data["hidden_size"],
        intermediate_size=data["intermediate_size"],
        num_hidden_layers=data["num_hidden_layers"],
        num_attention_heads=data["num_attention_heads"],
        num_key_value_heads=data.get("num_key_value_heads", data["num_attention_heads"]),
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        rope_theta=data.get("rope_theta", rope.get("rope_theta", 10000.0)),
        tie_word_embeddings=data.get("tie_word_embeddings", False),
        max_position_embeddings=data.get("max_position_embeddings", 32768),
        torch_dtype=data.get("torch_dtype") or data.get("dtype") or "float32",
        bos_token_id=data.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary embeddings, half-split ("rotate_half") convention as in HF Qwen2."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # Not a buffer: recomputed per call (D/2 values), so meta-device construction and
        # dtype casts of the model never touch it.
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, D], positions [..., T] -> rotated x."""
        exponents = torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [..., T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)  # [..., T, 1, D]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: Qwen2Config, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, kv = config.hidden_size, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, hidden, bias=True)
        self.k_proj = nn.Linear(hidden, kv, bias=True)
        self.v_proj = nn.Linear(hidden, kv, bias=True)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary):
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        return rotary(q, positions), rotary(k, positions), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Dense: x [B, T, hidden], positions [B, T]."""
        q, k, v = self._qkv(x, positions, rotary)
        out = dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(x.shape))

    def forward_varlen(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                       cu_seqlens: list[int]) -> torch.Tensor:
        """Packed: x [num_tokens, hidden], positions [num_tokens] (from 0 in each sequence)."""
        q, k, v = self._qkv(x, positions, rotary)
        return self.o_proj(varlen_attention(q, k, v, cu_seqlens).reshape(x.shape))

    def forward_paged(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                      kv_cache: torch.Tensor, batch: PagedBatch,
                      cache_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Paged: x [num_tokens, hidden], positions [num_tokens] (or what ``rotary`` takes).
        ``cache_positions`` [num_tokens]: each token's place in its sequence's cache, when the
        rotary positions are not it (multimodal rotary); by default ``positions``."""
        q, k, v = self._qkv(x, positions, rotary)
        write_kv(kv_cache[self.layer], k, v, batch.slot_mapping)
        places = positions if cache_positions is None else cache_positions
        out = paged_attention(q, kv_cache[self.layer], places, batch)
        return self.o_proj(out.reshape(x.shape))


class MLP(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """``checkpointed``: in a backward pass the layer's activations are recomputed instead of
    kept (activation checkpointing); inside the layer's call, so the hooks of a wrapper on the
    layer (FSDP2's unshard) run once, outside the recomputed part."""

    def __init__(self, config: Qwen2Config, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.checkpointed = False

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._forward, x, attend, use_reentrant=False)
        return self._forward(x, attend)

    def _forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """The decoder stack (HF prefix ``model.``). ``rotary``: the position embedding its
    attention applies (default :class:`Rotary` of the config; Qwen2-VL passes its multimodal
    one)."""

    def __init__(self, config: Qwen2Config, rotary: Rotary | None = None):
        super().__init__()
        # nn.Embedding's own init (normal_), skipped on the meta device, where the loader
        # builds a model before its weights arrive: a meta normal_ runs a Python reference
        # that imports torch._dynamo (1.5 s, most of `tiderl engine serve`'s start-up)
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary if rotary is not None else Rotary(config.head_dim, config.rope_theta)

    def hidden_states(self, input_ids: torch.Tensor, attend) -> torch.Tensor:
        return self.run_layers(self.embed_tokens(input_ids), attend)

    def run_layers(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The layers and the final norm over embedded tokens x [..., hidden]."""
        for layer in self.layers:
            x = layer(x, attend)
        return self.norm(x)


class DecoderLM(nn.Module):
    """What the text model and the vision-language one share: ``config``, the decoder
    ``model`` (a :class:`Qwen2Model`) and ``lm_head``, set by the subclass's ``__init__``."""

    config: Qwen2Config
    model: Qwen2Model
    lm_head: nn.Linear

    def tie_weights(self) -> None:
        """Share the embedding with ``lm_head`` when the config says so (call again after
        ``to_empty``, which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed paged cache for the decoder, on its device, in its dtype."""
        c = self.config
        return new_kv_cache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads,
                            c.head_dim, self.dtype, self.device)

    def _decode(self, x: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: list[int] | None, targets: torch.Tensor | None,
                target_rows: torch.Tensor | None, chunk_tokens: int) -> torch.Tensor:
        """The layers over embedded tokens ``x``, then the head: dense logits, or packed
        (``cu_seqlens``) logits or the targets' log-probabilities (see ``forward``)."""
        rotary = self.model.rotary
        if cu_seqlens is None:
            def attend(attn: Attention, h: torch.Tensor) -> torch.Tensor:
                return attn(h, positions, rotary)

            return self.lm_head(self.model.run_layers(x, attend))

        def attend_varlen(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            return attn.forward_varlen(h, positions, rotary, cu_seqlens)

        hidden = self.model.run_layers(x, attend_varlen)
        if targets is None or target_rows is None:
            return self.lm_head(hidden)
        return chunked_target_logprobs(self.lm_head, hidden[target_rows], targets, chunk_tokens)


class Qwen2ForCausalLM(DecoderLM):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.config = config
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                cu_seqlens: list[int] | None = None, targets: torch.Tensor | None = None,
                target_rows: torch.Tensor | None = None,
                chunk_tokens: int = 1024) -> torch.Tensor:
        """Dense causal forward: input_ids [B, T] -> logits [B, T, vocab].

        Sequences in a batch are right-padded (padding after the real tokens never changes the
        logits of real tokens under a causal mask). ``positions`` defaults to 0..T-1.

        Packed (``cu_seqlens``): input_ids and positions [N] hold sequences back to back,
        sequence s in rows ``cu_seqlens[s]:cu_seqlens[s + 1]``, positions from 0 in each. With
        ``targets`` and ``target_rows`` [M] it returns [M] float32: the log-probability of
        ``targets[i]`` after row ``target_rows[i]``, computed ``chunk_tokens`` rows at a time,
        each chunk's logits recomputed in backward rather than kept (no [N, vocab] tensor).
        Without them it returns the packed logits [N, vocab].
        """
        if cu_seqlens is None and positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            positions = positions.expand_as(input_ids)
        assert positions is not None, "a packed forward needs each token's position"
        return self._decode(self.model.embed_tokens(input_ids), positions, cu_seqlens, targets,
                            target_rows, chunk_tokens)

    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: torch.Tensor, batch: PagedBatch,
                      logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Paged forward of packed new tokens: input_ids, positions [num_tokens] -> logits
        [num_tokens, vocab], or only the rows ``logits_indices`` (e.g.
        ``batch.last_token_indices()`` when sampling). Writes this step's keys and values into
        ``kv_cache`` (layout in :mod:`tiderl.models.attention`) in place."""
        rotary = self.model.rotary

        def attend(attn: Attention, x: torch.Tensor) -> torch.Tensor:
            return attn.forward_paged(x, positions, rotary, kv_cache, batch)

        hidden = self.model.hidden_states(input_ids, attend)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.lm_head(hidden)


def chunked_target_logprobs(lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                            chunk_tokens: int) -> torch.Tensor:
    """[M] float32: log p(targets[i]) from the hidden state ``hidden[i]``, the lm_head run
    ``chunk_tokens`` rows at a time, each chunk's logits recomputed in backward rather than kept
    (with gradients enabled)."""
    parts = [checkpoint(_target_logprobs, lm_head, hidden[i:i + chunk_tokens],
                        targets[i:i + chunk_tokens], use_reentrant=False)
             if torch.is_grad_enabled() else
             _target_logprobs(lm_head, hidden[i:i + chunk_tokens], targets[i:i + chunk_tokens])
             for i in range(0, len(targets), chunk_tokens)]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _target_logprobs(lm_head: nn.Module, hidden: torch.Tensor,
                     targets: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(model: Qwen2ForCausalLM, input_ids: torch.Tensor,
                   loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log-probability of each next token (dense path), for the trainer.

    input_ids [B, T], loss_mask [B, T] (1 where a token's logprob counts, e.g. generated
    tokens) -> [B, T] float32 where ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``
    for t >= 1; ``out[:, 0]`` and masked positions are 0. Differentiable.
    """
    logits = model(input_ids)[:, :-1].float()  # all of [B, T, vocab]: the reference path
    targets = input_ids[:, 1:]
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = picked - torch.logsumexp(logits, dim=-1)
    out = torch.cat((logprobs.new_zeros(input_ids.shape[0], 1), logprobs), dim=1)
    if loss_mask is not None:
        out = out * loss_mask.to(out.dtype)
    return out


def packed_token_logprobs(model: nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                          chunk_tokens: int = 1024, images: BatchImages | None = None
                          ) -> torch.Tensor:
    """:func:`token_logprobs` without padding and without the [B, T, vocab] logits: the same
    [B, T] result (``out[b, t]`` where ``loss_mask[b, t]``, 0 elsewhere), from one packed
    forward of each row up to its last loss token (later tokens cannot change an earlier
    logprob under the causal mask) and the lm_head over loss positions only, in chunks.

    ``model`` is a :class:`Qwen2ForCausalLM` or a wrapper that forwards its call (DDP, FSDP2).
    A batch without loss tokens still runs one token through every weight, so a rank with
    nothing to train joins its backend's gradient reduction with zero gradients.

    ``images`` (a model that reads images, :mod:`tiderl.models.image_batch`): the rows' mrope
    positions and pixels; the images within the packed tokens go through the call (the vision
    tower runs inside it, and trains unless frozen)."""
    batch, width = input_ids.shape
    device = input_ids.device
    mask = loss_mask != 0
    mask[:, 0] = False  # the first token has no logprob
    rows, cols = mask.nonzero(as_tuple=True)
    if rows.numel() == 0:  # nothing to train: one token, weight 0
        out = model(input_ids[:1, :1].reshape(1), torch.zeros(1, dtype=torch.long, device=device),
                    cu_seqlens=[0, 1], targets=input_ids[:1, 0], target_rows=torch.zeros(
                        1, dtype=torch.long, device=device))
        return out.new_zeros(batch, width) + 0.0 * out.sum()
    positions = torch.arange(width, device=device)
    last = torch.where(mask, positions, -1).amax(dim=1)  # per row; -1: no loss token
    lengths = (last + 1).clamp(min=0)
    keep = positions.unsqueeze(0) < lengths.unsqueeze(1)  # [B, T]: the packed tokens
    starts = torch.cumsum(lengths, 0) - lengths
    cu_seqlens = [0, *torch.cumsum(lengths[lengths > 0], 0).tolist()]
    packed_positions, extra = positions.expand(batch, width)[keep], {}
    if images is not None:
        packed_positions = images.positions[:, keep]
        pixels, grids, image_rows = images.packed(lengths.tolist(), starts.tolist())
        extra = {"image_rows": image_rows}
        if pixels is not None:
            extra |= {"pixel_values": pixels, "image_grid_thw": grids}
    picked = model(input_ids[keep], packed_positions, cu_seqlens=cu_seqlens,
                   targets=input_ids[rows, cols], target_rows=starts[rows] + cols - 1,
                   chunk_tokens=chunk_tokens, **extra)
    out = picked.new_zeros(batch, width)
    return out.index_put((rows, cols), picked)
