"""A training sample: one finished trajectory as the trainer consumes it (no torch here: the
coordinator builds and keeps them; :mod:`tiderl.trainer.batch` packs them into tensors).

Its token ids, the loss mask (1 on model-generated tokens only: environment observations are
context, not targets), the behaviour logprobs the rollout engine returned for those tokens, its
GRPO advantage and the oldest policy version among its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

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
