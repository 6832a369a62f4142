"""The screenshot sliding window and the training segments it cuts (paper App. C.2).

A multimodal task appends a screenshot to its context every turn. Once the context holds
``limit`` images, the oldest are dropped so that the newest ``keep`` remain: the context is cut
before the first dropped image and rebuilt without the dropped ones, so the KV cache stays valid
only up to that cut. Each such pruning closes a *training segment*: the context as it stood before
the pruning is one training sequence (its loss on the outputs generated since the previous
pruning), and the task goes on in a new one. A task that never prunes is one sequence.

One rule for the simulator (:mod:`tiderl.sim.workload` draws turn plans with it) and the runtime
(:mod:`tiderl.runtime.agent` applies it to real contexts); :func:`segment_id` names the
sequences in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.core.config import require
from tiderl.core.quote import short
from tiderl.core.types import ImageRef


@dataclass(frozen=True, slots=True)
class ImageWindow:
    """On reaching ``limit`` images in a context, keep only the newest ``keep``."""

    limit: int = 10
    keep: int = 5

    def __post_init__(self) -> None:
        require(isinstance(self.limit, int) and isinstance(self.keep, int)
                and 0 < self.keep < self.limit, "keep",
                f"expected whole numbers 0 < keep < limit, got limit {short(self.limit)}, "
                f"keep {short(self.keep)}")

    def to_drop(self, live: int) -> int:
        """How many of the oldest images to drop from a context that now holds ``live`` (the
        newest just appended): ``live - keep`` once ``live`` reaches ``limit``, else 0."""
        return live - self.keep if live >= self.limit else 0

    def live_after(self, appended: int) -> int:
        """Images in a context after ``appended`` turns of one screenshot each."""
        live = 0
        for _ in range(appended):
            live += 1
            live -= self.to_drop(live)
        return live


def segment_id(task_id: str, k: int, num_segments: int) -> str:
    """The id of training sequence ``k`` of a task's ``num_segments`` (the task's own id when
    its trajectory is one sequence)."""
    return task_id if num_segments == 1 else f"{task_id}#{k}"


def task_of(seq_id: str) -> str:
    """The task a training sequence belongs to (:func:`segment_id` read back)."""
    return seq_id.partition("#")[0]


def drop_images(ids: list[int], images: Sequence[ImageRef], count: int, margin: int = 1
                ) -> tuple[list[int], list[ImageRef]]:
    """``ids`` without the oldest ``count`` of its ``images`` (in offset order): each image's
    placeholder tokens go with ``margin`` tokens on either side (the vision start and end
    markers), and the images after them shift left. The ids before the first dropped image are
    unchanged, so their KV stays valid."""
    ordered = sorted(images, key=lambda image: image.offset)
    dropped, kept = ordered[:count], ordered[count:]
    cuts = [(image.offset - margin, image.offset + image.num_tokens + margin)
            for image in dropped]
    out: list[int] = []
    at = 0
    for start, end in cuts:
        out.extend(ids[at:start])
        at = end
    out.extend(ids[at:])
    return out, [image.shifted(-sum(end - start for start, end in cuts
                                    if end <= image.offset)) for image in kept]
