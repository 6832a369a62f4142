"""Megatron-core as an optional trainer backend: our Qwen2 as a megatron ``GPTModel``.

megatron-core is an extra (``pip install tiderl[megatron]``); nothing here imports it at module
level, so this module (and the conversion's docs) load without it. Building a ``GPTModel`` and
converting weights work on CPU; its forward does not (megatron-core 0.16 allocates the causal mask
and the attention buffer with ``torch.cuda``), so :class:`MegatronBackend` needs CUDA.

The model uses ``get_gpt_layer_local_spec`` (plain PyTorch modules, no Transformer Engine),
pipeline parallel 1 and tensor parallel ``trainer.tensor_parallel``. Its parameter names
(megatron-core 0.16.1) against ours (HF)::

    model.embed_tokens.weight              embedding.word_embeddings.weight
    model.layers.N.input_layernorm.weight  decoder.layers.N.input_layernorm.weight
    ...self_attn.{q,k,v}_proj.{weight,bias}  decoder.layers.N.self_attention.linear_qkv.*
    ...self_attn.o_proj.weight             decoder.layers.N.self_attention.linear_proj.weight
    ...post_attention_layernorm.weight     decoder.layers.N.pre_mlp_layernorm.weight
    ...mlp.{gate,up}_proj.weight           decoder.layers.N.mlp.linear_fc1.weight
    ...mlp.down_proj.weight                decoder.layers.N.mlp.linear_fc2.weight
    model.norm.weight                      decoder.final_layernorm.weight
    lm_head.weight                         output_layer.weight (absent when tied)

``linear_qkv`` rows are grouped by key/value head: for each query group g, the rows of its query
heads, then k_g, then v_g (``SelfAttention.get_query_key_value_tensors`` views the output as
[groups, (heads_per_group + 2) * head_dim] and splits it). ``linear_fc1`` is [gate; up]
(``MLP.glu`` chunks it in two and activates the first half).

Under tensor parallelism each TP rank holds a slice (:func:`tp_shard`, :func:`tp_merge`): the
column-parallel ``linear_qkv`` (whole query groups per rank, as the grouped layout puts them
contiguously), ``word_embeddings`` and ``output_layer`` (vocabulary rows) split their rows;
``linear_fc1`` splits gate and up each and stacks the rank's halves; the row-parallel
``linear_proj`` and ``linear_fc2`` split their columns; the norms are whole on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tiderl.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, token_logprobs

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

INSTALL_HINT = "pip install tiderl[megatron]"
_EXTRA_STATE = "._extra_state"


class BackendUnavailable(RuntimeError):
    """The megatron backend cannot run here (megatron-core missing, or no CUDA)."""


def _require_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(
            f"the megatron backend needs megatron-core: {INSTALL_HINT}") from exc


def qwen2_transformer_config(config: Qwen2Config, *, params_dtype: torch.dtype = torch.float32,
                             use_cpu_initialization: bool = False) -> TransformerConfig:
    """The megatron ``TransformerConfig`` of our Qwen2 architecture.

    Dropout is off (Qwen2 has none, and RL logprobs must be deterministic). Gradient-accumulation
    fusion is off: it writes into megatron DDP's ``main_grad``, which torch DDP and AdamW never
    read (the other fusions are off by default). ``perform_initialization`` is off: every weight
    is loaded from the Qwen2 model right after construction. ``use_cpu_initialization`` builds
    on CPU instead of the current CUDA device (tests).
    """
    _require_megatron()
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads, kv_channels=config.head_dim,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        params_dtype=params_dtype, use_cpu_initialization=use_cpu_initialization,
        perform_initialization=False, gradient_accumulation_fusion=False)


def build_gpt_model(config: Qwen2Config, *, params_dtype: torch.dtype = torch.float32,
                    use_cpu_initialization: bool = False,
                    parallel_output: bool = True) -> GPTModel:
    """An uninitialised ``GPTModel`` with our architecture; needs ``init_model_parallel``.
    Under TP its logits are this rank's vocabulary slice unless ``parallel_output`` is False
    (then gathered over the TP group: every rank gets all of them)."""
    _require_megatron()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        qwen2_transformer_config(config, params_dtype=params_dtype,
                                 use_cpu_initialization=use_cpu_initialization),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope", rotary_base=config.rope_theta,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        parallel_output=parallel_output)


def init_model_parallel(seed: int = 0, tensor_parallel_size: int = 1) -> None:
    """Megatron's global groups, pipeline parallel 1, once per process: TP groups are blocks of
    ``tensor_parallel_size`` consecutive ranks of the world.

    ``initialize_model_parallel`` is a collective over the whole world (it creates its groups
    with ``new_group``), so every rank must call this together, e.g. at start-up where the
    runtime creates its other groups. Its data-parallel group spans the world; the backend
    reduces gradients over its own group with torch DDP, so that group does not matter here.
    """
    _require_megatron()
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel_size, 1)
    if torch.cuda.is_available() and not tensor_parallel.get_cuda_rng_tracker().is_initialized():
        # The local attention forks the tracker's stream around its (zero) dropout.
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _layer_names(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              config: Qwen2Config) -> torch.Tensor:
    """[q; k; v] rows (weight or bias) -> megatron's per-group [q heads of g; k_g; v_g]."""
    groups, dim = config.num_key_value_heads, config.head_dim
    tail = q.shape[1:]
    parts = (q.reshape(groups, -1, *tail), k.reshape(groups, dim, *tail),
             v.reshape(groups, dim, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor,
               config: Qwen2Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, dim = config.num_key_value_heads, config.head_dim
    q_rows = config.num_attention_heads // groups * dim
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, q_rows + 2 * dim, *tail).split((q_rows, dim, dim), dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_mcore(state: dict[str, torch.Tensor], config: Qwen2Config) -> dict[str, torch.Tensor]:
    """Our (HF-named) weights -> the ``GPTModel`` parameters of :func:`build_gpt_model`.

    The result has every parameter of the model and nothing else (``lm_head.weight`` is not
    read when embeddings are tied); ``load_mcore_state_dict`` adds megatron's empty extra states.
    """
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        hf, mc = _layer_names(i)
        attn = hf + "self_attn."
        for kind in ("weight", "bias"):
            out[f"{mc}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                state[f"{attn}q_proj.{kind}"], state[f"{attn}k_proj.{kind}"],
                state[f"{attn}v_proj.{kind}"], config)
        out[mc + "self_attention.linear_proj.weight"] = state[attn + "o_proj.weight"]
        out[mc + "input_layernorm.weight"] = state[hf + "input_layernorm.weight"]
        out[mc + "pre_mlp_layernorm.weight"] = state[hf + "post_attention_layernorm.weight"]
        out[mc + "mlp.linear_fc1.weight"] = torch.cat(
            (state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"]))
        out[mc + "mlp.linear_fc2.weight"] = state[hf + "mlp.down_proj.weight"]
    return out


def mcore_to_hf(state: dict[str, torch.Tensor], config: Qwen2Config) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_mcore`: ``GPTModel`` weights -> our HF-named state dict
    (with ``lm_head.weight`` the embedding when tied, as ``Qwen2ForCausalLM.state_dict`` has it).
    Megatron's ``_extra_state`` entries are ignored."""
    embed = state["embedding.word_embeddings.weight"]
    out = {"model.embed_tokens.weight": embed,
           "model.norm.weight": state["decoder.final_layernorm.weight"],
           "lm_head.weight": embed if config.tie_word_embeddings else state["output_layer.weight"]}
    for i in range(config.num_hidden_layers):
        hf, mc = _layer_names(i)
        attn = hf + "self_attn."
        for kind in ("weight", "bias"):
            q, k, v = _split_qkv(state[f"{mc}self_attention.linear_qkv.{kind}"], config)
            out.update({f"{attn}q_proj.{kind}": q, f"{attn}k_proj.{kind}": k,
                        f"{attn}v_proj.{kind}": v})
        out[attn + "o_proj.weight"] = state[mc + "self_attention.linear_proj.weight"]
        out[hf + "input_layernorm.weight"] = state[mc + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[mc + "pre_mlp_layernorm.weight"]
        gate, up = state[mc + "mlp.linear_fc1.weight"].chunk(2)
        out[hf + "mlp.gate_proj.weight"] = gate
        out[hf + "mlp.up_proj.weight"] = up
        out[hf + "mlp.down_proj.weight"] = state[mc + "mlp.linear_fc2.weight"]
    return out


_COLUMN_PARALLEL = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight",
                    "linear_qkv.bias")
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
_GLU = "linear_fc1.weight"


def tp_shard(state: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s slice of whole ``GPTModel`` weights (:func:`hf_to_mcore` output)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(_GLU):
            gate, up = tensor.chunk(2)
            tensor = torch.cat((gate.chunk(tp)[rank], up.chunk(tp)[rank]))
        elif name.endswith(_ROW_PARALLEL):
            tensor = tensor.chunk(tp, dim=1)[rank]
        elif name.endswith(_COLUMN_PARALLEL):
            tensor = tensor.chunk(tp)[rank]
        out[name] = tensor.contiguous()
    return out


def tp_merge(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`tp_shard`: the TP ranks' slices, in rank order, as whole weights."""
    out = {}
    for name, first in shards[0].items():
        parts = [shard[name] for shard in shards]
        if name.endswith(_GLU):
            halves = [part.chunk(2) for part in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif name.endswith(_ROW_PARALLEL):
            out[name] = torch.cat(parts, dim=1)
        elif name.endswith(_COLUMN_PARALLEL):
            out[name] = torch.cat(parts)
        else:
            out[name] = first
    return out


def mcore_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """A ``GPTModel``'s state dict without megatron's ``_extra_state`` entries (None here: they
    hold Transformer Engine FP8 metadata, which the local spec does not have)."""
    return {k: v.detach() for k, v in module.state_dict().items()
            if not k.endswith(_EXTRA_STATE)}


def load_mcore_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Strict ``load_state_dict`` of :func:`hf_to_mcore` output: megatron's linears declare an
    ``_extra_state`` key that strict loading requires, so the module's own (empty) ones are
    passed back with the weights."""
    extra = {k: v for k, v in module.state_dict().items() if k.endswith(_EXTRA_STATE)}
    with torch.no_grad():
        module.load_state_dict({**extra, **state}, strict=True)


class MegatronBackend:
    """Our Qwen2's weights in a megatron-core ``GPTModel`` (local spec, PP = 1, TP as
    :func:`init_model_parallel` set it), data parallel over ``group`` with torch
    ``DistributedDataParallel``. Under TP, ``group`` is the data-parallel group (the actors with
    this rank's TP index) and each rank holds its TP slice of every weight.

    Why torch DDP and not megatron's own: megatron's ``DistributedDataParallel`` accumulates into
    ``param.main_grad`` buffers (``.grad`` stays None) and reduces them only when
    ``finish_grad_sync()`` is called, which only megatron's optimizer does. Our workers step a
    plain ``torch.optim.AdamW`` on ``parameters()`` after backward, exactly as with the DDP
    backend. A TP-sliced parameter's gradient is this rank's slice (megatron's layers reduce
    over the TP group in their backward), so DDP over the data-parallel group is all it needs;
    clipping takes the norm over the whole model (:meth:`clip_grad_norm`).
    """

    name = "megatron"
    rewraps = False  # its actor set is fixed for the job (ERS moves that change it are refused)

    def __init__(self, model: Qwen2ForCausalLM, group: dist.ProcessGroup | None,
                 trainable: bool):
        _require_megatron()
        if model.device.type != "cuda":
            raise BackendUnavailable(
                "megatron backend needs CUDA: megatron-core's forward asserts a CUDA build")
        if not dist.is_initialized():
            raise RuntimeError("the megatron backend needs torch.distributed initialised "
                               "(tiderl.trainer.spawn.init_rank)")
        from megatron.core import parallel_state

        self.config = model.config
        self.group = group
        torch.cuda.set_device(model.device)  # megatron puts its buffers on the current device
        init_model_parallel()  # (a no-op after the rank's set-up made the groups)
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.gpt = build_gpt_model(self.config, params_dtype=model.dtype,
                                   parallel_output=self.tp == 1)
        self.load_full_state_dict(model.state_dict())
        self.module: nn.Module = self.gpt
        if trainable:
            self.module = nn.parallel.DistributedDataParallel(
                self.gpt, device_ids=[model.device.index], process_group=group,
                broadcast_buffers=False)

    @property
    def gathers(self) -> bool:
        """Under TP the whole weights are a gather over the TP group (every TP peer calls)."""
        return self.tp > 1

    @property
    def checkpoint_part(self) -> str:
        """The sub-folder of a checkpoint this rank's data-parallel group writes ("" at TP 1):
        each TP index saves its slices as its own DCP checkpoint."""
        return f"tp{self.tp_rank}" if self.tp > 1 else ""

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # attention_mask None: the local spec's causal softmax builds the causal mask itself.
        return self.module(input_ids, positions.expand_as(input_ids), None)

    def logprobs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 images: object = None) -> torch.Tensor:
        if images is not None:
            raise NotImplementedError("the megatron backend trains text models: a model that "
                                      "reads images trains on ddp or fsdp2")
        # token_logprobs only calls its model on the ids, so it takes the GPTModel forward and
        # the convention (out[:, 0] = 0, masked positions 0) stays defined in one place.
        return token_logprobs(self._logits, input_ids, loss_mask)  # type: ignore[arg-type]

    reduces_in_backward = True

    def grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        no_sync = getattr(self.module, "no_sync", None)
        return contextlib.nullcontext() if enabled or no_sync is None else no_sync()

    def reduce_gradients(self) -> None:
        pass  # torch DDP reduced them in the step's last backward

    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """HF-named whole weights; under TP a gather over the TP group (every peer calls), the
        result kept (on the CPU) only where ``keep``."""
        weights = mcore_weights(self.gpt)
        if self.tp > 1:
            weights = _gather_tp(weights, self.tp, self.tp_group, keep)
        return mcore_to_hf(weights, self.config) if keep else {}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        weights = hf_to_mcore(state, self.config)
        if self.tp > 1:
            weights = tp_shard(weights, self.tp, self.tp_rank)
        load_mcore_state_dict(self.gpt, weights)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Under megatron's names (the fused ``linear_qkv`` ...), not HF's."""
        return self.gpt.named_parameters()

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Clip by the norm of the whole model's gradient (:func:`tp_grad_norm` under TP), so
        every TP peer scales by the same factor and the replicated norms stay equal."""
        if self.tp == 1:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        wanted = {id(p) for p in params}
        norm = tp_grad_norm([(n, p) for n, p in self.gpt.named_parameters() if id(p) in wanted],
                            self.tp_group)
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
        return norm


def is_tp_sliced(name: str) -> bool:
    """Whether ``GPTModel`` parameter ``name`` is sliced over the TP group (:func:`tp_shard`'s
    rule; megatron's own ``tensor_model_parallel`` marks are set only by its initialisers,
    which a model loaded from weights skips)."""
    return name.endswith((_GLU, *_ROW_PARALLEL, *_COLUMN_PARALLEL))


def tp_grad_norm(named: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup | None) -> float:
    """The L2 norm of the whole model's gradient from this TP rank's ``GPTModel`` parameters:
    the squares of the sliced ones summed over the TP ``group`` (a collective), the replicated
    ones' (the norms, equal on every peer) counted once."""
    grads = [(is_tp_sliced(name), p.grad) for name, p in named if p.grad is not None]
    squares = torch.zeros(2, dtype=torch.float32, device=grads[0][1].device)
    for sliced, grad in grads:  # [sliced, replicated]
        squares[0 if sliced else 1] += grad.float().pow(2).sum()
    sliced_sum = squares[:1].clone()
    dist.all_reduce(sliced_sum, group=group)
    return float((sliced_sum[0] + squares[1]).sqrt())


def _gather_tp(weights: dict[str, torch.Tensor], tp: int, group: dist.ProcessGroup,
               keep: bool) -> dict[str, torch.Tensor]:
    """Every TP peer's slices, one weight at a time, merged (:func:`tp_merge`) where ``keep``."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in weights.items():
        parts = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        if keep:
            for peer, part in enumerate(parts):
                shards[peer][name] = part.cpu()
    return tp_merge(shards) if keep else {}
