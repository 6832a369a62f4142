"""The step cycle's state: its phase and hold, the open step, the boundary awaiting answers and
where the training groups are. Every field the cycle's parts share is in :class:`CycleState`;
each part keeps its own (the boundary out, the open step, the feed, the records, operator plans).

    Phase: what the cycle waits for before step ``step`` opens (allowed moves, ``PHASES``)

      LAUNCHING ──launch or restore──> BOUNDARY
      BOUNDARY ──every member acknowledged──> TRAINING (streaming), WAITING (its batch)
               ──after the last step──> FINISHED
      WAITING ──its batch is complete──> TRAINING
              ──a layout change first (the cold start ends, a trainer rank died, no rollout
                rank is left)──> BOUNDARY
      TRAINING ──the step ended (trained, or a trainer rank died in it)──> BOUNDARY

    Hold: what keeps the cycle from going on (allowed moves, ``HOLDS``)

      COLD_START  set at launch when the launch plan lends trainer ranks to rollout; released
                  when batch 0 is complete: a boundary brings them back, then step 0 opens
      EVALUATION  set when a step ends while evaluation groups are out (they run on an anchored
                  version); released when the last one is back: the post-update boundary
                  goes out
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tiderl.core.commands import StartStep
from tiderl.core.step_control.config import StepControlError
from tiderl.core.types import MicroBatch, Placement, PlanReason, Role


class Phase(str, Enum):
    LAUNCHING = "launching"  # before launch()
    BOUNDARY = "boundary"  # a boundary is out (or held back), its acknowledgements awaited
    WAITING = "waiting"  # a step waits for its batch, or for the cold start to end
    TRAINING = "training"  # a step is open
    FINISHED = "finished"


class Hold(str, Enum):
    COLD_START = "cold_start"
    EVALUATION = "evaluation"


PHASES: dict[Phase, frozenset[Phase]] = {
    Phase.LAUNCHING: frozenset({Phase.BOUNDARY}),
    Phase.BOUNDARY: frozenset({Phase.BOUNDARY, Phase.WAITING, Phase.TRAINING, Phase.FINISHED}),
    Phase.WAITING: frozenset({Phase.WAITING, Phase.TRAINING, Phase.BOUNDARY}),
    Phase.TRAINING: frozenset({Phase.BOUNDARY}),
    Phase.FINISHED: frozenset(),
}
HOLDS: dict[Hold | None, frozenset[Hold | None]] = {
    None: frozenset({Hold.COLD_START, Hold.EVALUATION}),
    Hold.COLD_START: frozenset({None}),
    Hold.EVALUATION: frozenset({None}),
}


@dataclass
class CycleState:
    """What every part of the cycle reads: the phase and hold, the step about to open (or open)
    and the version the trainer holds, the layout and the dead ranks, RA2P's placement and the
    reason of the plan that laid the coming steps out, and the job's clock marks."""

    roles: list[Role]
    t0: float  # the job's launch on the adapter's clock
    trainer_free_at: float  # when the trainer ranks were last free (the previous step's end)
    phase: Phase = Phase.LAUNCHING
    hold: Hold | None = None
    step: int = 0
    version: int = 0
    dead: set[int] = field(default_factory=set)
    placement: Placement = Placement.COLOCATED
    plan_reason: PlanReason | None = None

    def to(self, phase: Phase) -> None:
        if phase not in PHASES[self.phase]:
            raise StepControlError(f"the step cycle cannot go from {self.phase.value} to "
                                   f"{phase.value}")
        self.phase = phase

    def updated(self, now: float) -> None:
        """Step ``step`` trained: the next one is due, on the version it made."""
        self.step += 1
        self.version += 1
        self.trainer_free_at = now

    def set_hold(self, hold: Hold | None) -> None:
        if hold is not self.hold and hold not in HOLDS[self.hold]:
            raise StepControlError(f"hold {hold} cannot follow {self.hold}")
        self.hold = hold


@dataclass
class OpenStep:
    start: StartStep
    opened_at: float
    ready_at: float  # when its trainer ranks were free (the previous step's end)
    ras: int
    num_micro_batches: int = 0
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


def actors(roles: tuple[Role, ...] | list[Role], is_sync: bool) -> set[int]:
    """The actor ranks of ``roles``: every live rank under a synchronous system."""
    return {r for r, role in enumerate(roles)
            if role is Role.ACTOR or (is_sync and role is not Role.IDLE)}
