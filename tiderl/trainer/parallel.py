"""Data-parallel backends behind one interface: DDP, FSDP2 and (GPU only) Megatron-core.

A backend owns the model of one worker on the ranks of its process group. The workers only call:

- ``logprobs(input_ids, loss_mask)``: per-token logprobs of the next token (differentiable for a
  trainable backend), ``[B, T]`` as :func:`tiderl.models.qwen2.token_logprobs` defines them.
  DDP and FSDP2 compute them packed (no padding) and over loss positions only, in chunks of
  ``chunk_tokens`` (:func:`tiderl.models.qwen2.packed_token_logprobs`);
- ``grad_sync(enabled)``: a context in which backward accumulates locally (``enabled=False``:
  FSDP2 ``set_requires_gradient_sync(False)``) or reduces across the group;
- ``reduces_in_backward``: whether the step's last backward reduces the gradients (FSDP2,
  Megatron), so the caller must know at forward time which micro-batch is the last; the DDP
  backend accumulates every micro-batch locally and ``reduce_gradients()`` all-reduces them once,
  in one flat buffer, before the optimizer step (nothing to wait for while data streams in);
- ``reduce_gradients()``: that reduction (a no-op for a backend that reduces in backward);
- ``full_state_dict(keep=True)`` / ``load_full_state_dict()``: whole tensors under HF names. For
  a backend that ``gathers`` (FSDP2) it is a collective: every rank of the group calls it, one
  parameter at a time is all-gathered, and only a rank with ``keep`` holds the result (on the
  CPU); the others get an empty dict;
- ``rewraps``: whether the backend can wrap its same module again for a new group (DDP,
  Megatron); FSDP2 cannot (``fully_shard`` applies once), so a new actor set builds a fresh model
  from the full weights and shards it over the new group;
- ``parameters()`` for the optimizer, ``module`` for checkpoints.

Gradient reduction averages over the group (DDP and FSDP2 both divide by its size); the actor
undoes that when it normalises by the global token count (see ``ActorWorker.optimizer_step``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from tiderl.core.quote import short
from tiderl.models.image_batch import PixelCache, batch_images
from tiderl.models.image_rows import BatchImages, RowImages
from tiderl.models.qwen2 import Qwen2ForCausalLM, packed_token_logprobs

BACKENDS = ("ddp", "fsdp2", "megatron")


class TrainBackend(Protocol):
    name: str
    module: nn.Module
    group: dist.ProcessGroup | None

    def logprobs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 images: Sequence[RowImages] | None = None) -> torch.Tensor: ...

    @property
    def reduces_in_backward(self) -> bool: ...

    def grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager: ...

    def reduce_gradients(self) -> None: ...

    gathers: bool
    rewraps: bool
    checkpoint_part: str  # the sub-folder of a checkpoint this rank's group writes ("": none)

    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]: ...

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float: ...


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class _DenseBackend:
    """Shared by DDP and FSDP2: the Qwen2 forward through the wrapper."""

    def __init__(self, model: Qwen2ForCausalLM, module: nn.Module,
                 group: dist.ProcessGroup | None):
        self.model = model  # the unwrapped Qwen2 (its config and HF-named parameters)
        self.module = module
        self.group = group
        self.chunk_tokens = 1024
        self._pixels: PixelCache | None = None  # decoded images (a model that reads them)

    reduces_in_backward = True
    gathers = False
    rewraps = True
    checkpoint_part = ""

    def logprobs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 images: Sequence[RowImages] | None = None) -> torch.Tensor:
        """``images``: each row's (a model that reads images)."""
        return packed_token_logprobs(self.module, input_ids, loss_mask, self.chunk_tokens,
                                     self._images(input_ids, images))

    def _images(self, input_ids: torch.Tensor, images: Sequence[RowImages] | None
                ) -> BatchImages | None:
        if images is None:
            return None
        if self._pixels is None:
            self._pixels = PixelCache(self.model.image_settings)
        return batch_images(self.model.config, self._pixels, input_ids, images,
                            input_ids.device)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters()

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Clip to ``max_norm`` by the global norm, which it returns (FSDP2's sharded gradients
        give a ``DTensor`` norm over the mesh)."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def reduce_gradients(self) -> None:
        pass


class DDPBackend(_DenseBackend):
    """``DistributedDataParallel`` over the group; a frozen (ref) model is not wrapped, since it
    has no gradients to reduce.

    Every backward runs under ``no_sync``: the gradients of a step's micro-batches accumulate
    locally and ``reduce_gradients`` averages them over the group in one flat all-reduce (none
    on a group of one). DDP's own reduction in the last backward would need the forward to know
    that its micro-batch is the step's last, i.e. wait for the next one to arrive or the step to
    close, so a streamed step could not train a micro-batch while the next was still on its way.
    DDP still broadcasts rank 0's weights when it wraps the model."""

    name = "ddp"
    reduces_in_backward = False

    def __init__(self, model: Qwen2ForCausalLM, group: dist.ProcessGroup | None,
                 trainable: bool):
        module: nn.Module = model
        if trainable and dist.is_initialized():
            device_ids = [model.device.index] if model.device.type == "cuda" else None
            module = nn.parallel.DistributedDataParallel(
                model, device_ids=device_ids, process_group=group)
        super().__init__(model, module, group)

    def grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        del enabled  # always local: reduce_gradients reduces once per step
        no_sync = getattr(self.module, "no_sync", None)
        return contextlib.nullcontext() if no_sync is None else no_sync()

    def reduce_gradients(self) -> None:
        size = group_size(self.group)
        if size == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        for param in params:  # a rank that trained nothing joins with zeros
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(size)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The live tensors (no copy): sync or save them before the next optimizer step."""
        if not keep:
            return {}
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state, strict=True)


class FSDP2Backend(_DenseBackend):
    """``fully_shard`` on each decoder layer, then on the root, over a 1-D mesh of the group.

    On a GPU the parameters are gathered in bfloat16 for the forward and the gradients
    reduce-scattered in float32 (``MixedPrecisionPolicy``); the sharded master weights and
    AdamW's state stay float32. On the CPU everything stays float32."""

    name = "fsdp2"
    gathers = True
    rewraps = False

    def __init__(self, model: Qwen2ForCausalLM, group: dist.ProcessGroup | None,
                 trainable: bool):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        del trainable  # a frozen model is sharded too: FSDP2 saves its memory as well
        group = group or dist.group.WORLD
        mesh = DeviceMesh.from_group(group, model.device.type)
        policy = MixedPrecisionPolicy()
        if model.device.type == "cuda" and model.dtype == torch.float32:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        super().__init__(model, model, group)

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        # FSDP2 reads the flag in the backward hooks: keep it for the block, then sync again
        self.module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Every rank of the group must call this; see :func:`gather_full`."""
        return gather_full(self.module.state_dict(), keep)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True))


def gather_full(state: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Whole tensors of a (partly) sharded state dict, one entry at a time: each ``DTensor`` is
    all-gathered over its mesh (a collective: every rank of the mesh calls this with the same
    keys) and, where ``keep``, moved to the CPU before the next one is gathered, so a device
    holds at most one whole tensor beyond its shards. Plain tensors pass through (detached).
    Where not ``keep`` the result is empty. Entries that share one tensor (tied embeddings) are
    gathered once."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        if id(tensor) in seen:
            if keep:
                out[name] = seen[id(tensor)]
            continue
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            whole = whole.detach().cpu()
            seen[id(tensor)] = out[name] = whole
        else:
            seen[id(tensor)] = whole.new_empty(0)
    return out


def shard_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``param`` is: this rank's shard as a ``DTensor`` on ``param``'s mesh
    (cut locally, no communication: every rank holds the same whole tensor), or ``whole`` on
    ``param``'s device for a plain parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return whole.to(param.device)


def backend_class(name: str) -> type:
    """The class of backend ``name`` (for what a rank must know of it before it has one)."""
    if name == "megatron":
        from tiderl.trainer.megatron import MegatronBackend

        return MegatronBackend
    classes = {"ddp": DDPBackend, "fsdp2": FSDP2Backend}
    if name not in classes:
        raise ValueError(f"unknown trainer backend {short(name)}; "
                         f"expected one of {', '.join(BACKENDS)}")
    return classes[name]


def prepare_actor_imports() -> None:
    """Import now what wrapping an actor imports lazily. DDP's constructor (and FSDP2's) reads
    ``torch._dynamo``, whose first import takes ~1.3 s of CPU here; a rollout rank that ERS
    moves to the trainer would pay it inside the move, and the whole actor group waits for it
    in the wrap's first collective. A rank that may move pays it at start-up instead."""
    import torch._dynamo  # noqa: F401


def make_backend(name: str, model: Qwen2ForCausalLM, group: dist.ProcessGroup | None = None,
                 *, trainable: bool = True, chunk_tokens: int = 1024,
                 activation_checkpointing: bool = False) -> TrainBackend:
    """Wrap ``model`` (already on its device) for the ranks of ``group`` (None: the world).
    ``chunk_tokens``: loss positions per lm_head chunk; ``activation_checkpointing``: each
    decoder layer recomputed in backward (DDP, FSDP2: set before the wrap)."""
    if activation_checkpointing:
        enable = getattr(model, "enable_activation_checkpointing", None)  # an HF model's own
        if enable is not None:
            enable()
        else:
            for layer in model.model.layers:
                layer.checkpointed = True
    backend = backend_class(name)(model, group, trainable)
    backend.chunk_tokens = chunk_tokens
    return backend
