"""The job's shape: how many steps, how big a group and a batch, how stale a sample may be, how
often to evaluate. Declared once (the profile's ``job`` section) and read by both substrates:
the runtime's coordinator and the simulator build their step cycle from the same
:class:`JobShape`.

Batches are counted in GRPO groups (a group's advantages need every one of its tasks, so a step
never trains part of one); :attr:`JobShape.batch` gives them in samples, as the policies count.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiderl.core.config import require, require_non_negative, require_positive


@dataclass(frozen=True, slots=True)
class BatchBounds:
    """The elastic global batch in samples: ERS sizes each step's batch in [min, ideal]."""

    min: int
    ideal: int


@dataclass(frozen=True)
class JobShape:
    steps: int = 20  # optimizer steps
    group_size: int = 8  # GRPO G: tasks per prompt
    batch_groups: int = 4  # B_ideal, in groups
    batch_min_groups: int = 2  # B_min, in groups (ERS's elastic batch)
    max_staleness: int = 1  # versions a sample may lag the update that trains it
    # a group that completes late (a straggler) still trains up to this many versions past
    # max_staleness, its tokens weighed by the behaviour logprobs of the versions that sampled
    # them; the staleness window still admits by max_staleness (0: a straggler is dropped)
    carry_versions: int = 1
    eval_every: int = 0  # steps between evaluations (step 0 included); 0: none
    eval_groups: int = 4  # groups of one evaluation
    eval_group_size: int = 0  # tasks per evaluation group; 0: group_size

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "batch_groups", "batch_min_groups"):
            require_positive(getattr(self, name), name)
        require(self.batch_min_groups <= self.batch_groups, "batch_min_groups",
                f"expected <= batch_groups ({self.batch_groups}), got {self.batch_min_groups}")
        for name in ("max_staleness", "carry_versions", "eval_every", "eval_groups",
                     "eval_group_size"):
            require_non_negative(getattr(self, name), name)

    @property
    def batch(self) -> BatchBounds:
        return BatchBounds(self.batch_min_groups * self.group_size,
                           self.batch_groups * self.group_size)

    @property
    def batch_ideal(self) -> int:
        """B_ideal in samples."""
        return self.batch_groups * self.group_size

    @property
    def eval_size(self) -> int:
        """Tasks per evaluation group."""
        return self.eval_group_size or self.group_size
