"""The step cycle's explicit state: its phase, the open step, the boundary awaiting answers, and
where the training groups are."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tiderl.core.commands import GroupSpec, StartStep
from tiderl.core.types import MicroBatch, PlanReason, Role


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
    sent: list[MicroBatch] = field(default_factory=list)  # dispatched, in order
    is_closed: bool = False  # CloseStep went out
    is_aborted: bool = False  # a trainer rank of it died: AbortStep went out


@dataclass
class PendingBoundary:
    version: int
    awaiting: set[int]  # members whose acknowledgement opens the next step
    syncing: set[int]  # rollout members whose new weights move the staleness window
    joining: set[int]  # ranks CTB places tasks on once they acknowledge
    old_roles: tuple[Role, ...] = ()  # the layout before it (a boundary sent again starts there)
    reason: PlanReason | None = None
    is_resume: bool = False

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


@dataclass
class Evaluation:
    """The evaluation phases: ``num_groups`` groups every ``every`` steps (step 0 included; 0:
    none), which groups are out, and the last step whose groups were fed."""

    every: int
    num_groups: int
    in_flight: set[str] = field(default_factory=set)
    fed_at: int = -1

    def is_due(self, step: int) -> bool:
        """Step ``step`` starts an evaluation not fed yet (its groups go out when it opens)."""
        return bool(self.every and self.num_groups and step % self.every == 0
                    and self.fed_at != step)

    def is_phase(self, step: int) -> bool:
        return self.is_due(step) or bool(self.in_flight)

    def num_unfinished(self, step: int) -> int:
        """Groups the phase still has to run: those out, and those due at ``step``."""
        return len(self.in_flight) + (self.num_groups if self.is_due(step) else 0)

    def feed(self, step: int) -> tuple[GroupSpec, ...]:
        """Step ``step``'s groups, now out (none unless due)."""
        if not self.is_due(step):
            return ()
        self.fed_at = step
        specs = tuple(GroupSpec(f"e{step}.{i}", i, True, step) for i in range(self.num_groups))
        self.in_flight.update(spec.group_id for spec in specs)
        return specs

    def finish(self, group_id: str) -> bool:
        """True when ``group_id`` was the phase's last group out."""
        self.in_flight.discard(group_id)
        return not self.in_flight
