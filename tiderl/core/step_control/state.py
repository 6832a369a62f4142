"""The step cycle's explicit state: its phase, the open step, the boundary awaiting answers, and
where the training groups are."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tiderl.core.commands import StartStep


class Phase(str, Enum):
    LAUNCHING = "launching"  # before launch()
    BOUNDARY = "boundary"  # a boundary is out; its acknowledgements are awaited
    WAITING = "waiting"  # a whole-batch step waits for its batch
    TRAINING = "training"  # a step is open
    FINISHED = "finished"


@dataclass
class OpenStep:
    start: StartStep
    opened_at: float
    ready_at: float  # when its trainer ranks were free (the previous step's end)
    ras: int
    num_mbs: int = 0
    tokens: int = 0
    samples: int = 0
    group_ids: set[str] = field(default_factory=set)


@dataclass
class PendingBoundary:
    version: int
    awaiting: set[int]  # members whose acknowledgement opens the next step
    syncing: set[int]  # rollout members whose new weights move the staleness window
    joining: set[int]  # ranks CTB places tasks on once they acknowledge

    def forget(self, rank: int) -> None:
        for ranks in (self.awaiting, self.syncing, self.joining):
            ranks.discard(rank)


@dataclass
class GroupCount:
    """Training groups by where they are (what the job's stop event reports)."""

    fed: int = 0
    ready: int = 0
    trained_ids: set[str] = field(default_factory=set)
    stale: int = 0
    failed: int = 0

    def as_dict(self) -> dict[str, int]:
        trained = len(self.trained_ids)
        return {"fed": self.fed, "trained": trained, "dropped": self.stale + self.failed,
                "buffered": self.ready - trained - self.stale,
                "rolling_out": self.fed - self.ready - self.failed}
