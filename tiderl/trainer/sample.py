"""A training sample: one finished trajectory as the trainer consumes it (no torch here: the
coordinator builds and keeps them; :mod:`tiderl.trainer.batch` packs them into tensors).

Its token ids, the loss mask (1 on model-generated tokens only: environment observations are
context, not targets), the behaviour logprobs the rollout engine returned for those tokens, its
GRPO advantage and the oldest policy version among its tokens; for a model that reads images,
the images among its ids (:class:`~tiderl.core.types.ImageRef`) and their PNG bytes by content
hash. A trajectory the screenshot window pruned is several samples, one per segment, named
``<task>#<k>`` (:func:`tiderl.core.segments.segment_id`), each with the task's advantage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tiderl.core.segments import segment_id
from tiderl.core.types import ImageRef, Segment, SeqRef, Trajectory


@dataclass(frozen=True)
class TrainSample:
    seq_id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]  # behaviour logprob of each token (0.0 where the mask is 0)
    advantage: float
    version: int = 0  # oldest policy version among its tokens
    images: tuple[ImageRef, ...] = ()
    image_data: Mapping[str, bytes] = field(default_factory=dict)  # PNG bytes by ImageRef.key

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
    def from_trajectory(cls, trajectory: Trajectory, advantage: float,
                        image_data: Mapping[str, bytes] | None = None) -> list[TrainSample]:
        """The trajectory's training samples, one per segment (one for a trajectory the
        screenshot window never pruned, named as its task)."""
        segments = trajectory.segments()
        return [cls._of_segment(segment_id(str(trajectory.task_id), k, len(segments)), seg,
                                advantage, image_data or {})
                for k, seg in enumerate(segments)]

    @classmethod
    def _of_segment(cls, seq_id: str, seg: Segment, advantage: float,
                    image_data: Mapping[str, bytes]) -> TrainSample:
        model_versions = [v for v in seg.versions if v >= 0]
        missing = {image.key for image in seg.images} - image_data.keys()
        if missing:
            raise ValueError(f"sample {seq_id}: no pixels for images {sorted(missing)}")
        return cls(seq_id=seq_id, input_ids=tuple(seg.ids), loss_mask=tuple(seg.mask),
                   logprobs=tuple(seg.logprobs), advantage=advantage,
                   version=min(model_versions, default=0), images=seg.images,
                   image_data={image.key: image_data[image.key] for image in seg.images})
