"""A rank's place in the job: its torch.distributed world and the model every role builds.

    init_rank (gloo on CPU, NCCL on GPU) ──> every trainer group of tiderl.core.rank_sets (and,
        under megatron TP, the data-parallel groups of the fixed actor set), made once at
        start-up, so no group is built at run time
    the weight feed (tiderl.trainer.weight_feed) ──> where the other ranks fetch the weights
        this rank publishes as a boundary's source (its address goes out in Hello)
    the profile's model ──> its config, tokenizer, turn encoder (chat template), image placer,
        and the layouts of its weights and AdamW state that every weight sync follows
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tiderl.auth import WEIGHTS, resolve_token
from tiderl.core.rank_sets import trainer_sets
from tiderl.core.types import Role
from tiderl.engine.scheduler import eos_set
from tiderl.models.chat import TurnEncoder, turn_encoder
from tiderl.models.image_turns import ImagePlacer, image_placer
from tiderl.models.loading import model_from_config
from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.profile import Profile
from tiderl.trainer.spawn import init_rank
from tiderl.trainer.sync import Layout, param_layout
from tiderl.trainer.weight_feed import WeightFeed, local_address
from tiderl.trainer.worker import optimizer_layout


@dataclass(frozen=True)
class RankArgs:
    rank: int
    world_size: int
    run_dir: Path
    bus: str  # the coordinator's ROUTER endpoint
    dist_init: str  # tcp://host:port of the torch.distributed store
    env_url: str
    role: Role
    device: str = "cpu"
    threads: int = 1
    cpu_slot: tuple[int, int] | None = None  # (i, n): pin to the i-th of n core sets
    engine_url: str = ""  # this rank's engine server (engine backends other than embedded)
    dist_backend: str = ""  # the world's ("": by device; gloo where ranks share a device)
    memory_fraction: float = 0.0  # of its CUDA device this process may take (0: no cap)


def ranks_with(roles: list[Role] | tuple[Role, ...], role: Role,
               is_sync: bool) -> tuple[int, ...]:
    """The ranks of ``role``; under ``is_sync`` every live rank (an idle one died)."""
    if is_sync:
        return tuple(r for r, x in enumerate(roles) if x is not Role.IDLE)
    return tuple(r for r, x in enumerate(roles) if x is role)


@dataclass(frozen=True)
class ModelKit:
    """What every role knows of the job's model: its config and tokenizer, how a turn becomes
    ids (``encoder``) and where its images go (``placer``), and the layouts a weight sync of its
    weights (``weights``) and of its AdamW state (``optimizer``) follows."""

    config: object
    tokenizer: object
    encoder: TurnEncoder
    placer: ImagePlacer | None
    weights: Layout
    optimizer: Layout


class RankWorld:
    """The process groups of this rank and the model's builder (see the module docstring)."""

    def __init__(self, args: RankArgs, profile: Profile) -> None:
        self.args, self.profile = args, profile
        self.rank = args.rank
        self.device = torch.device(args.device)
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # this rank's, sorted ranks
        self.dp_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # megatron under TP
        self.kit: ModelKit | None = None
        self.feed: WeightFeed | None = None
        self.feed_address = ""  # host:port where the other ranks fetch from this one

    def join(self, initial_roles: list[Role], is_sync: bool) -> None:
        """Join the world, open the weight feed, create every trainer group. A member that
        dies mid-collective can leave the others blocked (gloo does not always see the closed
        connection): bounded by ``collective_timeout_s``, the collective fails."""
        args, profile = self.args, self.profile
        ctx = init_rank(self.rank, args.world_size, args.dist_init, device=args.device,
                        threads=args.threads, backend=args.dist_backend,
                        memory_fraction=args.memory_fraction)
        self.device = ctx.device
        timeout_s = profile.runtime.collective_timeout_s
        self.feed = WeightFeed(self.feed_token, wait_s=timeout_s)
        master = args.dist_init.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        self.feed_address = f"{local_address(master)}:{self.feed.port}"
        timeout = timedelta(seconds=timeout_s)
        for ranks in trainer_sets(args.world_size):
            group = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                self.groups[ranks] = group
        if profile.trainer.backend != "megatron":
            return
        from tiderl.trainer.megatron import init_model_parallel  # collectives over the world

        tp = profile.trainer.tensor_parallel
        init_model_parallel(profile.model.seed, tp)
        actors = ranks_with(initial_roles, Role.ACTOR, is_sync)  # the (fixed) actor set
        for index in range(tp if tp > 1 else 0):  # its data-parallel groups, by TP index
            ranks = tuple(r for r in actors if r % tp == index)
            group = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                self.dp_groups[ranks] = group

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()

    @property
    def feed_token(self) -> str:
        return resolve_token(WEIGHTS) or ""

    def initial(self, device: torch.device | None = None) -> tuple[Qwen2ForCausalLM, object]:
        """The model of version 0 (the folder's weights, or the seeded random init) and its
        tokenizer."""
        return model_from_config(self.profile.model, device or self.device)

    def model(self, device: torch.device | None = None) -> Qwen2ForCausalLM:
        return self.initial(device)[0]

    def describe(self, model: Qwen2ForCausalLM, tokenizer: object) -> ModelKit:
        """Learn the model from one built copy (before the job starts: a chat template needs
        transformers, seconds to import, and any rank may roll out once ERS moves it)."""
        profile = self.profile
        encoder = turn_encoder(profile.model.path or None, tokenizer,
                               eos_set(model.config.eos_token_id), profile.model.chat_template)
        self.kit = ModelKit(model.config, tokenizer, encoder,
                            image_placer(profile.model.path or None, model.config, encoder),
                            param_layout(model), optimizer_layout(model))
        return self.kit

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        return self.groups[tuple(sorted(ranks))]

    def dp_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The data-parallel group of this rank among ``ranks``: all of them, or under
        megatron TP the ones of this rank's TP index (TP groups: consecutive ranks)."""
        tp = self.profile.trainer.tensor_parallel
        if tp == 1 or len(ranks) == 1:
            return self.group(ranks)
        return self.dp_groups[tuple(r for r in sorted(ranks) if r % tp == self.rank % tp)]
