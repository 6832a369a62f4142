"""Training samples (:class:`tiderl.trainer.sample.TrainSample`) packed into tensors: ``pack``
right-pads a list of samples into one batch (padding after the real tokens never changes their
logits under a causal mask, and it carries mask 0), each row's images beside it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tiderl.models.image_rows import RowImages
from tiderl.trainer.sample import TrainSample


@dataclass
class PackedBatch:
    """One rank's share of a micro-batch as tensors ``[B, T]`` (advantages ``[B]``)."""

    seq_ids: tuple[str, ...]
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    images: list[RowImages] | None = None  # per row (a model that reads images), else None

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
    images = [[(ref, s.image_data[ref.key]) for ref in s.images] for s in samples] \
        if any(s.images for s in samples) else None
    return PackedBatch(tuple(s.seq_id for s in samples), ids.to(device), mask.to(device),
                       old.to(device), advantages.to(device), images)
