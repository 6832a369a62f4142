"""Actor (policy + AdamW) and Ref (frozen) workers on the ranks of their backend's group.

The actor splits a micro-batch's work in two so that the loss can be deferred (paper §5.1,
Fig. 6): ``forward`` runs the policy and keeps the graph; ``backward`` builds the GRPO loss from
those logprobs and the ref logprobs (which may arrive later, from another rank) and back-propagates
it. ``train`` is the ordinary order (ref logprobs first), used by the colocated executor. Gradients
of a step accumulate unnormalised; ``optimizer_step`` scales them by 1/N (N = the step's loss
tokens over all ranks), clips, steps and bumps the version.

A new actor rank joins with the source actor's AdamW state: ``optimizer_state`` packs it as plain
tensors named ``{param}.exp_avg``, ``{param}.exp_avg_sq`` and ``{param}.step`` (the entries of
:func:`optimizer_layout`, which every rank of the broadcast builds from its own model), and
``load_optimizer_state`` installs what was received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tiderl.trainer.batch import PackedBatch
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.loss import LossStats, grpo_loss_sum
from tiderl.trainer.parallel import TrainBackend, gather_full, group_size, shard_like
from tiderl.trainer.sync import Layout, state_layout

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_layout(model: nn.Module) -> Layout:
    """What a sync of an actor's AdamW state carries, from the model's parameters alone (a rank
    without an actor takes part in the broadcast too): both moments in float32 and the step."""
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
        return self.backend.logprobs(batch.input_ids, batch.loss_mask)


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
    (``TrainerConfig.lr_at``), whatever optimizer is installed."""

    def __init__(self, backend: TrainBackend, config: TrainerConfig, version: int = 0,
                 total_steps: int = 0):
        self.backend = backend
        self.config = config
        self.version = version
        self.total_steps = total_steps
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
            logprobs = self.backend.logprobs(batch.input_ids, batch.loss_mask)
        return PendingLoss(batch, logprobs, sync)

    def backward(self, pending: PendingLoss, ref_logprobs: torch.Tensor | None) -> LossStats:
        """Build the loss (with its KL to ``ref_logprobs``) and back-propagate it."""
        batch = pending.batch
        loss_sum, stats = grpo_loss_sum(
            pending.logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
            ref_logprobs if self.config.kl_beta > 0 else None,
            clip_eps=self.config.clip_eps, kl_beta=self.config.kl_beta)
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
        return StepStats(self.version, global_loss_tokens, grad_norm, lr)

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
