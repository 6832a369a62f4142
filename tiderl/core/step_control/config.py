"""What the step cycle needs of a job, the launch layout and the layouts a substrate refuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.ctb import CTBConfig
from tiderl.core.ers import ERSConfig
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.rank_sets import MAX_ALL_SUBSETS, has_group
from tiderl.core.system import SystemSpec
from tiderl.core.types import Mode, Role


class StepControlError(RuntimeError):
    """An event the step cycle cannot take (a bug in its adapter, or a plan with no actor)."""


def task_id(group_id: str, index: int) -> str:
    """The id of task ``index`` of a group, the same on both substrates."""
    return f"{group_id}.{index}"


def initial_roles(system: SystemSpec, num_ranks: int, num_rollout: int,
                  ra2p_mode: str) -> list[Role]:
    """The launch layout: rollout ranks first, then the trainer (a Ref rank first when RA2P runs
    and is fixed to decoupled); every rank rolls out under a synchronous system."""
    if system.is_sync:
        return [Role.ROLLOUT] * num_ranks
    trainer = [Role.ACTOR] * (num_ranks - num_rollout)
    if system.uses_ra2p and ra2p_mode == Mode.DECOUPLED.value and len(trainer) >= 2:
        trainer[0] = Role.REF
    return [Role.ROLLOUT] * num_rollout + trainer


@dataclass(frozen=True)
class LayoutLimits:
    """Layouts a substrate cannot run: actor sets without a process group (``grouped_ranks``:
    the world the runtime made its groups for, see :mod:`tiderl.core.rank_sets`; None: any set
    runs) and, with ``fixed_actor_backend`` (a trainer backend that wraps its ranks once), any
    change of the actor set. ``sharded_actor_backend``: a trainer backend that shards the model
    and its optimizer state over the actors (FSDP2), so that an actor's death loses state no
    other rank holds; with neither, every actor holds a whole replica and the others go on
    without a dead one."""

    grouped_ranks: int | None = None
    fixed_actor_backend: str = ""
    sharded_actor_backend: str = ""

    def refusal(self, old: list[Role], new: list[Role]) -> str | None:
        """Why ``new`` cannot follow ``old`` here, in one line; None if it can."""
        actors = {r for r, role in enumerate(new) if role is Role.ACTOR}
        old_actors = {r for r, role in enumerate(old) if role is Role.ACTOR}
        if new != old and self.grouped_ranks is not None \
                and not has_group(actors, self.grouped_ranks):
            return f"no process group for actor set {sorted(actors)}"
        if actors != old_actors and self.fixed_actor_backend:
            return f"trainer.backend {self.fixed_actor_backend} keeps its actor set"
        return None

    def loss_refusal(self, is_actor: bool, holders: set[int], live: set[int],
                     actors: set[int]) -> str | None:
        """Why the job cannot go on without a rank that died, in words that follow "it"; None
        if it can. ``is_actor``: it was an actor; ``holders``: the live actors left that hold the
        whole model and optimizer state; ``live``: the ranks left, and ``actors`` their actor set
        (the weight broadcast and the gradient reduction need a process group for each). A Ref
        or rollout rank holds nothing the others lack; a DDP actor's replica is whole on each
        other actor."""
        if is_actor:
            backend = self.sharded_actor_backend or self.fixed_actor_backend
            if backend:
                what = "shards the model over its actors" if self.sharded_actor_backend \
                    else "keeps its actor set"
                return f"was an actor, and trainer.backend {backend} {what}"
            if not holders:
                return "was the last actor that held the model and optimizer state"
        if self.grouped_ranks is not None:
            for ranks, what in ((live, "ranks"), (actors, "actors")):
                if ranks and not has_group(ranks, self.grouped_ranks):
                    return (f"left {what} {sorted(ranks)}, which have no process group (past "
                            f"{MAX_ALL_SUBSETS} ranks a job has groups for contiguous ranges "
                            "only)")
        return None

    def with_rollout(self, roles: list[Role], dead: set[int]) -> list[Role] | None:
        """``roles`` with a trainer rank moved to rollout (no live rank rolls out: the last
        died): a Ref rank if there is one, else the last actor of several, as these limits
        allow; None when no rank can move."""
        alive = [r for r in range(len(roles)) if r not in dead]
        actors = [r for r in alive if roles[r] is Role.ACTOR]
        for rank in [r for r in alive if roles[r] is Role.REF] + actors[1:][::-1]:
            moved = list(roles)
            moved[rank] = Role.ROLLOUT
            if self.refusal(roles, moved) is None:
                return moved
        return None


@dataclass(frozen=True)
class StepControlConfig:
    """``ctb`` is used as given under TideRL with CTB, else as the request-level baseline;
    ``ers`` gives every system its batch bounds and plans only under TideRL with ERS;
    ``rank_budget`` is CTB's B_r; ``max_new_tokens`` the generation cap of one turn (the
    footprint rule); ``checkpoint_every`` asks the actors for a checkpoint at those versions,
    ``export_every`` for an HF folder of the weights (both also after the last step)."""

    system: SystemSpec
    num_steps: int
    group_size: int
    max_staleness: int
    ctb: CTBConfig
    ra2p: RA2PConfig
    ers: ERSConfig
    rank_budget: int
    max_new_tokens: int
    eval_every: int = 0
    eval_groups: int = 0
    checkpoint_every: int = 0
    export_every: int = 0
    tensor_parallel: int = 1  # actors per model replica: micro-batches are cut for the replicas
    limits: LayoutLimits = field(default_factory=LayoutLimits)
