"""What the step cycle needs of a job: its configuration, the launch layout and the layouts a
substrate refuses, and :func:`effective_config`, the one place where the policies' configs are
made what a system runs (both substrates build their cycle through it)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from tiderl.core.ctb import CTBConfig
from tiderl.core.ers import ERSConfig
from tiderl.core.job import JobShape
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.rank_sets import MAX_ALL_SUBSETS, has_group
from tiderl.core.system import System, SystemSpec
from tiderl.core.types import Placement, Role


class StepControlError(RuntimeError):
    """An event the step cycle cannot take (a bug in its adapter, or a plan with no actor)."""


def task_id(group_id: str, index: int) -> str:
    """The id of task ``index`` of a group, the same on both substrates."""
    return f"{group_id}.{index}"


def group_of_task(task: str) -> str:
    """The group of a task (:func:`task_id` read back)."""
    return task.rpartition(".")[0]


def initial_roles(system: SystemSpec, num_ranks: int, num_rollout: int,
                  placement: str) -> list[Role]:
    """The launch layout: rollout ranks first, then the trainer (a Ref rank first when RA2P runs
    and is fixed to decoupled); every rank rolls out under a synchronous system."""
    if system.is_sync:
        return [Role.ROLLOUT] * num_ranks
    trainer = [Role.ACTOR] * (num_ranks - num_rollout)
    if system.uses_ra2p and placement == Placement.DECOUPLED.value and len(trainer) >= 2:
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
        (the gradient reduction needs a process group for each). A Ref
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
    """The step cycle of one system on one job, as :func:`effective_config` makes it: ``ctb``,
    ``ra2p`` and ``ers`` are what the system runs (request-level rollout for a baseline, ...);
    ``rank_budget`` is CTB's B_r; ``max_new_tokens`` the generation cap of one turn (the
    footprint rule); ``window_tasks`` the batch CTB's staleness window counts in tasks
    (B_ideal, wider with over-provisioning); ``checkpoint_every`` asks the actors for a
    checkpoint at those versions, ``export_every`` for an HF folder of the weights (both also
    after the last step); ``tensor_parallel`` actors per model replica (micro-batches are cut
    for the replicas)."""

    system: SystemSpec
    job: JobShape
    ctb: CTBConfig
    ra2p: RA2PConfig
    ers: ERSConfig
    rank_budget: int
    max_new_tokens: int
    window_tasks: int
    kv_block_tokens: int = 0
    checkpoint_every: int = 0
    export_every: int = 0
    tensor_parallel: int = 1
    limits: LayoutLimits = field(default_factory=LayoutLimits)

    @property
    def max_staleness(self) -> int:
        """The staleness the window admits by (0 for a synchronous system)."""
        return self.system.max_staleness(self.job.max_staleness)

    @property
    def drop_staleness(self) -> int:
        """The staleness past which a ready group is dropped: ``max_staleness`` and, but for a
        synchronous system (it has no stragglers: every step waits for its batch), the
        versions a straggler is carried (``job.carry_versions``)."""
        carry = 0 if self.system.is_sync else self.job.carry_versions
        return self.max_staleness + carry

    @property
    def has_ers(self) -> bool:
        return self.system.uses_ers and self.ers.enabled


@dataclass(frozen=True)
class Substrate:
    """What the substrate a job runs on fixes for its step cycle: one rollout rank's KV tokens
    (B_r is ``ctb.budget_fraction`` of it), a turn's generation cap, whether the loss has a KL
    term (without one no step runs a Ref pass), what it saves and when, the layouts it cannot
    run, and the trainer's floor in ranks (a model's sharded training state needs that many
    devices), and whether every rank runs on cores the OS shares among them all
    (``shared_cores``: CPU ranks not pinned, where a rank waiting for data already leaves its
    CPU time to the others). The simulator's baselines add their own knobs: StreamRL's
    micro-batch target and AReaL's over-provisioning (APRIL: the staleness window holds
    ``over_provision - 1`` extra batches)."""

    kv_tokens: int
    max_new_tokens: int
    kv_block_tokens: int = 0  # the engines' KV block (a group's prompt is shared in them)
    has_kl: bool = True
    checkpoint_every: int = 0
    export_every: int = 0
    tensor_parallel: int = 1
    limits: LayoutLimits = field(default_factory=LayoutLimits)
    min_trainer_ranks: int = 1
    request_concurrency: int | None = None
    stream_tokens_per_rank: int | None = None
    over_provision: float = 1.0
    shared_cores: bool = False


def effective_ctb(ctb: CTBConfig, *, policy: str | None = None,
                  request_concurrency: int | None = None) -> CTBConfig:
    """``ctb`` with the policy a system runs (None: as configured) and, where the substrate
    fixes it, the running requests request-level admission fills per rank (the simulator's
    engines: ``sim.request_concurrency``)."""
    if policy is not None and policy != ctb.policy:
        ctb = replace(ctb, policy=policy)
    if request_concurrency is not None and request_concurrency != ctb.request_concurrency:
        ctb = replace(ctb, request_concurrency=request_concurrency)
    return ctb


def effective_config(system: SystemSpec, job: JobShape, ctb: CTBConfig, ra2p: RA2PConfig,
                     ers: ERSConfig, substrate: Substrate) -> StepControlConfig:
    """The configuration ``system`` runs on ``job``: the one place a policy's config is
    rewritten (``tiderl launch --dry-run`` and ``tiderl sim --dry-run`` print it).

    - without CTB (every baseline, and the ablation) rollout is request-level: ``ctb.policy``
      is ``request``, filling the substrate's running requests where it fixes them;
    - RA2P's choice is colocated where no step can run decoupled: without a KL term (no Ref
      pass) an ``auto`` placement, and ERS's view of a system without RA2P (it moves ranks but never
      provisions a Ref rank);
    - stream cuts micro-batches to its own target where the substrate gives one;
    - ERS keeps at least the substrate's trainer floor and, where the ranks share their cores,
      lends no rank at a cold start and moves none on a deficit: a moved rank adds no capacity
      there, and its two role switches and its trial cost time (measured on 2 cores: goodput
      +2.4% without the cold start's loan over 5 paired runs; 1.058x without the deficits'
      moves over 4 rounds, ``bench/results/e2e_pairs_noers.json``);
    - the staleness window counts ``job.batch_ideal`` tasks per batch, times the over-
      provisioning under async."""
    ctb = effective_ctb(ctb, policy=None if system.uses_ctb else "request",
                        request_concurrency=substrate.request_concurrency)
    if not substrate.has_kl and ra2p.placement == "auto":
        ra2p = replace(ra2p, placement=Placement.COLOCATED.value)
    if not system.uses_ra2p:
        ra2p = replace(ra2p, placement=Placement.COLOCATED.value)
    if system.system is System.STREAM and substrate.stream_tokens_per_rank is not None:
        ra2p = replace(ra2p, tokens_per_rank=substrate.stream_tokens_per_rank)
    if substrate.min_trainer_ranks > ers.min_trainer_ranks:
        ers = replace(ers, min_trainer_ranks=substrate.min_trainer_ranks)
    if substrate.shared_cores and system.uses_ers and (ers.cold_start_steps or ers.signal_moves):
        ers = replace(ers, cold_start_steps=0, signal_moves=False)
    window_tasks = job.batch_ideal
    if system.system is System.ASYNC and substrate.over_provision > 1.0:
        bound, over = system.max_staleness(job.max_staleness), substrate.over_provision
        window_tasks = round(job.batch_ideal * (bound + over) / (bound + 1))
    return StepControlConfig(
        system=system, job=job, ctb=ctb, ra2p=ra2p, ers=ers,
        rank_budget=ctb.rank_budget(substrate.kv_tokens),
        max_new_tokens=substrate.max_new_tokens, window_tasks=window_tasks,
        kv_block_tokens=substrate.kv_block_tokens,
        checkpoint_every=substrate.checkpoint_every, export_every=substrate.export_every,
        tensor_parallel=substrate.tensor_parallel, limits=substrate.limits)


def effective_view(config: StepControlConfig, ctb: CTBConfig, ra2p: RA2PConfig,
                   ers: ERSConfig) -> dict[str, object]:
    """What ``tiderl launch --dry-run`` and ``tiderl sim --dry-run`` print of ``config``: the
    system, every policy setting it runs with another value than the profile's ``ctb``,
    ``ra2p`` and ``ers`` (``changes``: key -> [the profile's, the one run]) and what it derives
    (B_r, the generation cap, the staleness window, whether ERS plans)."""
    changes = {f"{name}.{f.name}": [getattr(given, f.name), getattr(used, f.name)]
               for name, given, used in (("ctb", ctb, config.ctb), ("ra2p", ra2p, config.ra2p),
                                         ("ers", ers, config.ers))
               for f in fields(given) if getattr(given, f.name) != getattr(used, f.name)}
    return {"system": config.system.label, "changes": changes,
            "rank_budget_tokens": config.rank_budget, "max_new_tokens": config.max_new_tokens,
            "window_tasks": config.window_tasks, "max_staleness": config.max_staleness,
            "drop_staleness": config.drop_staleness,
            "has_ers": config.has_ers}
