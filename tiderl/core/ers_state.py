"""ERS's memory between plans (:mod:`tiderl.core.ers`): the direction of the last move, the
recent boundaries' readings, a phase's saved layout, the move on trial and the damped
directions. Plain data: the job's resume point carries it (``ResumePoint.ers``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tiderl.core.types import Placement, Role, RoleChange


class Direction(str, Enum):
    """Which way a plan moved ranks."""

    TO_ROLLOUT = "to_rollout"
    TO_TRAINER = "to_trainer"


@dataclass(frozen=True, slots=True)
class Trial:
    """A signal-driven move on probation: it laid out step ``step`` on, and stays only if the
    ``trial_steps`` steps from there train faster than ``baseline`` (the steps before it)."""

    direction: Direction
    changes: tuple[RoleChange, ...]
    placement: Placement  # the placement before the move
    step: int
    baseline: float


@dataclass(frozen=True, slots=True)
class Block:
    """A reverted direction: no signal-driven move that way before step ``until``; ``steps`` is
    the block's length (a revert in a row that way doubles it)."""

    direction: Direction
    until: int
    steps: int


@dataclass(frozen=True, slots=True)
class ERSState:
    """Hysteresis memory: the direction of the last signal-driven move, and what the boundaries
    since it read (``recent``: the last ``confirm_window``, oldest first; a deficit's direction,
    None where balanced); during a phase (cold start, evaluation), the layout and placement from
    before it; the move on trial; the damped directions, one block each."""

    last_direction: Direction | None = None
    recent: tuple[Direction | None, ...] = ()
    saved_roles: tuple[Role, ...] | None = None
    saved_placement: Placement | None = None
    trial: Trial | None = None
    blocks: tuple[Block, ...] = ()

    def block(self, direction: Direction) -> Block | None:
        return next((b for b in self.blocks if b.direction is direction), None)

    def unblocked(self, direction: Direction) -> tuple[Block, ...]:
        """The blocks of the other direction."""
        return tuple(b for b in self.blocks if b.direction is not direction)
