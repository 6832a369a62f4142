"""Data-parallel backends behind one interface: DDP, FSDP2 and (GPU only) Megatron-core.

A backend owns the model of one worker on the ranks of its process group. The workers only call:

- ``logprobs(input_ids, loss_mask)``: per-token logprobs of the next token (differentiable for a
  trainable backend), ``[B, T]`` as :func:`tiderl.models.qwen2.token_logprobs` defines them;
- ``grad_sync(enabled)``: a context in which backward accumulates locally (``enabled=False``:
  DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``) or reduces across the group;
- ``full_state_dict()`` / ``load_full_state_dict()``: whole tensors under HF names (a collective
  for FSDP2: every rank of the group must call it);
- ``parameters()`` for the optimizer, ``module`` for checkpoints.

Gradient reduction averages over the group (DDP and FSDP2 both divide by its size); the actor
undoes that when it normalises by the global token count (see ``ActorWorker.optimizer_step``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from tiderl.models.qwen2 import Qwen2ForCausalLM, token_logprobs

BACKENDS = ("ddp", "fsdp2", "megatron")


class TrainBackend(Protocol):
    name: str
    module: nn.Module
    group: dist.ProcessGroup | None

    def logprobs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor: ...

    def grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class _DenseBackend:
    """Shared by DDP and FSDP2: the Qwen2 dense forward through the wrapper."""

    def __init__(self, model: Qwen2ForCausalLM, module: nn.Module,
                 group: dist.ProcessGroup | None):
        self.model = model  # the unwrapped Qwen2 (for its config)
        self.module = module
        self.group = group

    def logprobs(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        return token_logprobs(self.module, input_ids, loss_mask)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()


class DDPBackend(_DenseBackend):
    """``DistributedDataParallel`` over the group; a frozen (ref) model is not wrapped, since it
    has no gradients to reduce."""

    name = "ddp"

    def __init__(self, model: Qwen2ForCausalLM, group: dist.ProcessGroup | None,
                 trainable: bool):
        module: nn.Module = model
        if trainable and dist.is_initialized():
            device_ids = [model.device.index] if model.device.type == "cuda" else None
            module = nn.parallel.DistributedDataParallel(
                model, device_ids=device_ids, process_group=group)
        super().__init__(model, module, group)

    def grad_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        no_sync = getattr(self.module, "no_sync", None)
        return contextlib.nullcontext() if enabled or no_sync is None else no_sync()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The live tensors (no copy): sync or save them before the next optimizer step."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state, strict=True)


class FSDP2Backend(_DenseBackend):
    """``fully_shard`` on each decoder layer, then on the root, over a 1-D mesh of the group."""

    name = "fsdp2"

    def __init__(self, model: Qwen2ForCausalLM, group: dist.ProcessGroup | None,
                 trainable: bool):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        del trainable  # a frozen model is sharded too: FSDP2 saves its memory as well
        group = group or dist.group.WORLD
        mesh = DeviceMesh.from_group(group, model.device.type)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        super().__init__(model, model, group)

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        # FSDP2 reads the flag in the backward hooks: keep it for the block, then sync again
        self.module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        return get_model_state_dict(self.module, options=options)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True))


def make_backend(name: str, model: Qwen2ForCausalLM, group: dist.ProcessGroup | None = None,
                 *, trainable: bool = True) -> TrainBackend:
    """Wrap ``model`` (already on its device) for the ranks of ``group`` (None: the world)."""
    if name == "ddp":
        return DDPBackend(model, group, trainable)
    if name == "fsdp2":
        return FSDP2Backend(model, group, trainable)
    if name == "megatron":
        from tiderl.trainer.megatron import MegatronBackend

        return MegatronBackend(model, group, trainable)
    raise ValueError(f"unknown trainer backend {name!r}; expected one of {', '.join(BACKENDS)}")
