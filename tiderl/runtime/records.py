"""What the coordinator keeps per GRPO group and per optimizer step (plain state, no policy)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.types import SeqRef, Task, Trajectory
from tiderl.runtime import bus as b
from tiderl.trainer.batch import TrainSample


class CoordinatorError(RuntimeError):
    """The job cannot go on (a trainer rank died or failed); the message says which."""


@dataclass
class GroupRun:
    """A GRPO group in flight: its tasks' specs and, as they finish, their trajectories."""

    group_id: str
    tasks: dict[str, Task]
    task_text: str
    is_eval: bool
    step: int  # the step whose phase it belongs to (eval) or its feeding batch (train)
    finished: dict[str, Trajectory] = field(default_factory=dict)
    samples: list[TrainSample] = field(default_factory=list)

    @property
    def is_complete(self) -> bool:
        return len(self.finished) == len(self.tasks)

    # the ReadyBuffer's view (core.buffer.ReadyGroup)
    @property
    def oldest_version(self) -> int:
        return min(s.version for s in self.samples)

    @property
    def sequences(self) -> tuple[SeqRef, ...]:
        return tuple(s.as_sequence() for s in self.samples)


@dataclass
class StepRun:
    step: int
    mode: str
    ref_ranks: list[int]
    actor_ranks: list[int]
    start: float
    ready_at: float  # when its trainer ranks were free (the previous boundary)
    ras: int
    done: dict[int, b.StepDone] = field(default_factory=dict)
    samples: list[TrainSample] = field(default_factory=list)
    num_mbs: int = 0

    @property
    def ranks(self) -> list[int]:
        return self.ref_ranks + self.actor_ranks
