"""Actor (policy + AdamW) and Ref (frozen) workers on the ranks of their backend's group.

The actor splits a micro-batch's work in two so that the loss can be deferred (paper §5.1,
Fig. 6): ``forward`` runs the policy and keeps the graph; ``backward`` builds the GRPO loss from
those logprobs and the ref logprobs (which may arrive later, from another rank) and back-propagates
it. ``train`` is the ordinary order (ref logprobs first), used by the colocated executor. Gradients
of a step accumulate unnormalised; ``optimizer_step`` scales them by 1/N (N = the step's loss
tokens over all ranks), clips, steps and bumps the version.

A new actor rank joins with the source actor's AdamW state: ``optimizer_state`` packs it as plain
tensors named ``{param}.exp_avg``, ``{param}.exp_avg_sq`` and ``{param}.step`` (the entries of
:func:`optimizer_layout`, which the source and a joining rank build from their own models), and
``load_optimizer_state`` installs what was received.

After each optimizer step the actor hands the C allocator's free pages back to the OS
(:func:`release_free_memory`). A step's activations are ~300 MiB of short-lived tensors (tiny
model, 2048-token micro-batches) whose sizes change with every micro-batch's shape; glibc serves
them from its heaps (its mmap threshold rises to the largest block freed, up to 32 MiB) and keeps
what is freed, fragmented, so without the trim a rank's resident set climbs to the worst layout
so far while the memory in use stays flat. ``bench/actor_memory.py`` over 150 steps: untrimmed,
the RSS goes from 520 MiB to 680-780 MiB with 255 live tensors and 136-141 MiB in use throughout
(no leak); trimmed, it stays at 345-352 MiB, for ~74k page faults a step (the step's working set
faulted back in: about 0.05 CPU-s of a 2 s step on a quiet machine).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import torch
from torch import nn

from tiderl.trainer.batch import PackedBatch
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.loss import LossStats, grpo_loss_sum
from tiderl.trainer.parallel import TrainBackend, gather_full, group_size, shard_like
from tiderl.trainer.sync import Layout, state_layout

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")


def _find_malloc_trim():
    """glibc's ``malloc_trim``, or None where the process's C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # no symbol table to search, or not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _find_malloc_trim()


def release_free_memory() -> bool:
    """Return the free pages of every glibc heap to the OS (``malloc_trim(0)``: each free
    chunk's whole pages, not only the heap tops); False, doing nothing, without glibc. Memory in
    use is untouched; the next step faults the pages it needs back in."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


def optimizer_layout(model: nn.Module) -> Layout:
    """What a sync of an actor's AdamW state carries, from the model's parameters alone (a rank
    joining the actors has none yet): both moments in float32 and the step."""
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        for key in ADAMW_MOMENTS:
            state[f"{name}.{key}"] = torch.empty(param.shape, dtype=torch.float32, device="meta")
        state[f"{name}.step"] = torch.empty((), dtype=torch.float32, device="meta")
    return state_layout(state)


class RefWorker:
    def __init__(self, backend: TrainBackend):
        self.backend = backend
        for param in backend.parameters():
            param.requires_grad_(False)

    @torch.no_grad()
    def ref_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        return self.backend.logprobs(batch.input_ids, batch.loss_mask, batch.images)


@dataclass
class PendingLoss:
    """An actor forward waiting for its ref logprobs: the batch and its logprobs (with graph)."""

    batch: PackedBatch
    logprobs: torch.Tensor
    sync: bool


@dataclass(frozen=True)
class StepStats:
    version: int
    loss_tokens: int
    grad_norm: float
    lr: float = 0.0


class ActorWorker:
    """``total_steps``: the job's optimizer steps, the horizon of a cosine schedule. Each
    ``optimizer_step`` sets the optimizer's learning rate to the schedule's rate of its version
    (``TrainerConfig.lr_at``), whatever optimizer is installed; every ``release_every``-th
    step (by version; 0: never) ends with :func:`release_free_memory`."""

    def __init__(self, backend: TrainBackend, config: TrainerConfig, version: int = 0,
                 total_steps: int = 0, *, release_every: int = 1):
        self.backend = backend
        self.config = config
        self.version = version
        self.total_steps = total_steps
        self.release_every = release_every
        self.optimizer = torch.optim.AdamW(backend.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)

    @property
    def reduces_in_backward(self) -> bool:
        """Whether the step's last backward reduces the gradients, so ``forward`` must be told
        which micro-batch is the last (FSDP2, Megatron); the DDP backend reduces them in
        ``optimizer_step`` and ignores ``sync``."""
        return self.backend.reduces_in_backward

    def forward(self, batch: PackedBatch, *, sync: bool) -> PendingLoss:
        """Policy logprobs of ``batch``. ``sync``: this is the step's last backward on this
        rank, where a backend that ``reduces_in_backward`` reduces gradients across the group
        (decided at forward time)."""
        with self.backend.grad_sync(sync):
            logprobs = self.backend.logprobs(batch.input_ids, batch.loss_mask, batch.images)
        return PendingLoss(batch, logprobs, sync)

    def backward(self, pending: PendingLoss, ref_logprobs: torch.Tensor | None) -> LossStats:
        """Build the loss (with its KL to ``ref_logprobs``) and back-propagate it."""
        batch = pending.batch
        loss_sum, stats = grpo_loss_sum(
            pending.logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
            ref_logprobs if self.config.kl_beta > 0 else None,
            clip_eps=self.config.clip_eps, kl_beta=self.config.kl_beta,
            is_weight_cap=self.config.loss_is_weight_cap)
        with self.backend.grad_sync(pending.sync):
            loss_sum.backward()
        return stats

    def train(self, batch: PackedBatch, ref_logprobs: torch.Tensor | None, *,
              sync: bool) -> LossStats:
        return self.backward(self.forward(batch, sync=sync), ref_logprobs)

    def optimizer_step(self, global_loss_tokens: int) -> StepStats:
        """Normalise the accumulated gradients by the step's loss tokens, clip and step.

        The group reduction averaged the ranks' sums, so the scale is ``group_size / N``."""
        self.backend.reduce_gradients()
        scale = group_size(self.backend.group) / max(global_loss_tokens, 1)
        params = [p for p in self.backend.parameters() if p.grad is not None]
        with torch.no_grad():
            for param in params:
                param.grad.mul_(scale)
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        grad_norm = self.backend.clip_grad_norm(params, max_norm)
        lr = self.config.lr_at(self.version, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.release_every and self.version % self.release_every == 0:
            release_free_memory()  # the step's activations and gradients are freed by now
        return StepStats(self.version, global_loss_tokens, grad_norm, lr)

    def discard_gradients(self) -> None:
        """A step that failed before its update: what its micro-batches accumulated goes (the
        step runs again from the same weights)."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The AdamW state under :func:`optimizer_layout`'s names, whole tensors; a parameter not
        stepped yet has zero moments and step 0. With a backend that ``gathers`` (FSDP2: sharded
        moments) this is a collective over the group and only a rank with ``keep`` gets it."""
        state: dict[str, torch.Tensor] = {}
        for name, param in self.backend.named_parameters():
            slot = self.optimizer.state.get(param, {})
            for key in ADAMW_MOMENTS:
                state[f"{name}.{key}"] = slot[key] if key in slot else torch.zeros(
                    param.shape, dtype=torch.float32, device=param.device)
            step = slot.get("step", torch.tensor(0.0))
            state[f"{name}.step"] = torch.as_tensor(step, dtype=torch.float32).reshape(())
        if self.backend.gathers:
            state = gather_full(state, keep)
        return {k: v.float() for k, v in state.items()} if keep else {}

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """Install an :meth:`optimizer_state` (as received from another actor) in place; each
        moment is laid out as its parameter is (this rank's shard under FSDP2)."""
        for name, param in self.backend.named_parameters():
            self.optimizer.state[param] = {
                "step": state[f"{name}.step"].clone().cpu(),
                **{key: shard_like(state[f"{name}.{key}"].to(param.dtype), param).clone()
                   for key in ADAMW_MOMENTS},
            }
