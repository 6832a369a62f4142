"""Training samples and their packing into tensors.

A ``TrainSample`` is one finished trajectory as the trainer consumes it: its token ids, the loss
mask (1 on model-generated tokens only: environment observations are context, not targets), the
behaviour logprobs the rollout engine returned for those tokens, its GRPO advantage and the oldest
policy version among its tokens. ``pack`` right-pads a list of samples into one batch (padding
after the real tokens never changes their logits under a causal mask, and it carries mask 0).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tiderl.core.types import SeqRef, Trajectory


@dataclass(frozen=True)
class TrainSample:
    seq_id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]  # behaviour logprob of each token (0.0 where the mask is 0)
    advantage: float
    version: int = 0  # oldest policy version among its tokens

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if not n or len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"sample {self.seq_id}: need equal, non-empty ids, mask and logprobs "
                             f"(got {n}, {len(self.loss_mask)}, {len(self.logprobs)})")
        if self.loss_mask[0]:
            raise ValueError(f"sample {self.seq_id}: the first token has no logprob to train on")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def as_sequence(self) -> SeqRef:
        """The core's view of it, for micro-batch formation and dispatch."""
        return SeqRef(self.seq_id, self.num_tokens)

    @classmethod
    def from_trajectory(cls, trajectory: Trajectory, advantage: float) -> TrainSample:
        ids, mask, logprobs, versions = trajectory.flatten()
        model_versions = [v for v in versions if v >= 0]
        return cls(seq_id=str(trajectory.task_id), input_ids=tuple(ids), loss_mask=tuple(mask),
                   logprobs=tuple(logprobs), advantage=advantage,
                   version=min(model_versions, default=0))


@dataclass
class PackedBatch:
    """One rank's share of a micro-batch as tensors ``[B, T]`` (advantages ``[B]``)."""

    seq_ids: tuple[str, ...]
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def pack(samples: Seq[TrainSample], device: torch.device | str = "cpu",
         pad_id: int = 0) -> PackedBatch:
    """Right-pad ``samples`` to their longest; an empty list gives a 1-token batch with mask 0
    (a rank without sequences still joins the gradient reduction with zero gradients)."""
    if not samples:
        zeros = torch.zeros(1, 1, device=device)
        return PackedBatch((), torch.full((1, 1), pad_id, device=device), zeros, zeros.clone(),
                           torch.zeros(1, device=device))
    width = max(s.num_tokens for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    old = torch.zeros(len(samples), width)
    for row, s in enumerate(samples):
        n = s.num_tokens
        ids[row, :n] = torch.tensor(s.input_ids)
        mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[row, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return PackedBatch(tuple(s.seq_id for s in samples), ids.to(device), mask.to(device),
                       old.to(device), advantages.to(device))
