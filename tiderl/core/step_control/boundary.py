"""The boundary: every live rank takes a layout and the weights of a version, and the next step
opens once each has acknowledged it.

    roles planned ──(no rollout rank left: a trainer rank moves, NO_ROLLOUT)──> Boundary(version,
        roles, old roles, members, source actor, joiners, checkpoint?, export?)
        ──> PendingBoundary: awaiting (every member), syncing (rollout members: the staleness
            window moves once they have the new version), joining (new rollout ranks: CTB places
            tasks on each once it acknowledged)

A checkpoint and an export are due at the first boundary of a version (after its update), never
at another one of the same version (a layout change without an update, or a boundary sent again
after a death), nor at the launch's or a resume's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.core.commands import Abort, Boundary
from tiderl.core.step_control.config import StepControlConfig, StepControlError
from tiderl.core.step_control.state import PendingBoundary, actors
from tiderl.core.types import PlanReason, Role


@dataclass
class Boundaries:
    """The boundary out, and the version of the last one sent."""

    pending: PendingBoundary | None = None
    last_version: int = -1

    def send(self, config: StepControlConfig, old: Sequence[Role], new: Sequence[Role], *,
             version: int, dead: set[int], reason: PlanReason | None, placed: set[int],
             is_final: bool = False, is_resume: bool = False) -> Boundary:
        """The boundary from layout ``old`` to ``new`` with the weights of ``version``, now
        pending (unless ``is_final``: after the last step, nothing waits for it).
        ``placed``: the ranks CTB places tasks on already; ``is_resume``: a resumed job's
        launch (every rank gets the weights; the rollout ranks take tasks once they have
        them)."""
        is_sync = config.system.is_sync
        old, new = tuple(old), tuple(new)
        old_actors, new_actors = actors(old, is_sync), actors(new, is_sync)
        keep = sorted(old_actors & new_actors)
        if not keep:
            raise StepControlError(f"a plan left no actor in place ({old} -> {new})")
        is_update = version != self.last_version
        self.last_version = version

        def is_due(every: int) -> bool:
            return bool(is_final or (not is_resume and is_update and every and version
                                     and version % every == 0))

        members = tuple(r for r in range(len(new)) if r not in dead)
        boundary = Boundary(version, new, old, members, keep[0],
                            tuple(sorted(new_actors - old_actors)), reason,
                            checkpoint=is_due(config.checkpoint_every),
                            export=is_due(config.export_every), is_final=is_final)
        if not is_final:
            rollout = {r for r in members if new[r] is Role.ROLLOUT or is_sync}
            joining = set(rollout) if is_resume else {
                r for r in members if new[r] is Role.ROLLOUT and old[r] is not Role.ROLLOUT}
            self.pending = PendingBoundary(version, set(members),
                                           rollout if version > 0 else set(),
                                           joining - placed, old, reason, is_resume)
        return boundary

    def acknowledge(self, rank: int, version: int) -> tuple[bool, bool] | None:
        """``rank`` took the boundary of ``version``: whether it joins rollout now and whether
        it was syncing; None when that is not the boundary out or not a rank it awaits."""
        pending = self.pending
        if pending is None or version != pending.version or rank not in pending.awaiting:
            return None
        pending.awaiting.discard(rank)
        is_joining, is_syncing = rank in pending.joining, rank in pending.syncing
        pending.joining.discard(rank)
        pending.syncing.discard(rank)
        return is_joining, is_syncing

    @property
    def is_syncing(self) -> bool:
        """A rollout rank still lacks the version of the boundary out."""
        return self.pending is not None and bool(self.pending.syncing)

    def complete(self) -> bool:
        """Every member of the boundary out acknowledged it: it is done."""
        if self.pending is None or self.pending.awaiting:
            return False
        self.pending = None
        return True


def dp_ranks(roles: list[Role], config: StepControlConfig) -> int:
    """Data-parallel ranks of the actors of ``roles``: each model replica spans
    ``tensor_parallel`` of them."""
    return max(1, len(actors(roles, config.system.is_sync)) // config.tensor_parallel)


def with_rollout_rank(roles: list[Role], reason: PlanReason | None, dead: set[int],
                      config: StepControlConfig
                      ) -> tuple[list[Role], PlanReason | None, list[Abort]]:
    """``roles`` as a boundary can send them: a layout where no live rank rolls out (the last
    died) moves a trainer rank to rollout (NO_ROLLOUT), as the layout limits allow; an Abort
    when none can move."""
    if config.system.is_sync or any(role is Role.ROLLOUT for r, role in enumerate(roles)
                                    if r not in dead):
        return roles, reason, []
    moved = config.limits.with_rollout(roles, dead)
    if moved is None:
        return roles, PlanReason.NO_ROLLOUT, [
            Abort("no rollout rank is left and no trainer rank can move to rollout")]
    return moved, PlanReason.NO_ROLLOUT, []
