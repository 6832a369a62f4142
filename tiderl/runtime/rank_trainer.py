"""A rank's trainer side, mixed into :class:`tiderl.runtime.rank.RankDaemon`: its Actor and Ref
workers on the trainer backend, the RA2P executor of each step, and its part in a boundary's
collectives (the gather of sharded weights, the broadcasts, the HF export, the checkpoint).

Every collective here runs in a worker thread (``asyncio.to_thread``), so the rank's event loop
keeps sending heartbeats while a gather or a broadcast blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tiderl.core.system import StepMode
from tiderl.core.types import Role
from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.models.qwen2_vl import Qwen2VLForCausalLM
from tiderl.profile import Profile
from tiderl.runtime.bus import StepDone, StepFailed, SyncWeights, TrainStep
from tiderl.runtime.rank_wire import step_done
from tiderl.trainer.checkpoint import load_checkpoint, save_checkpoint, step_dir
from tiderl.trainer.executors import ColocatedExecutor, DecoupledExecutor, StreamedStep
from tiderl.trainer.export import write_folder
from tiderl.trainer.parallel import backend_class, make_backend
from tiderl.trainer.sync import Layout, load_weights, sync_params
from tiderl.trainer.worker import ActorWorker, RefWorker

log = logging.getLogger("tiderl.rank")


class TrainerRoles:
    """The trainer half of a rank daemon (what it needs of the daemon is declared here)."""

    profile: Profile
    rank: int
    is_sync: bool
    version: int
    device: torch.device
    tokenizer: object
    model_config: object
    layout: Layout | None
    optimizer_layout: Layout | None
    actor_set: tuple[int, ...]
    actor: ActorWorker | None
    ref: RefWorker | None
    streams: dict[tuple[int, int], StreamedStep]
    groups: dict[tuple[int, ...], dist.ProcessGroup]  # this rank's, by their sorted ranks
    dp_groups: dict[tuple[int, ...], dist.ProcessGroup]
    _joined_optimizer: dict[str, torch.Tensor] | None

    def _initial_model(self, device: torch.device | None = None
                       ) -> tuple[Qwen2ForCausalLM, object]:
        raise NotImplementedError

    def _group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        raise NotImplementedError

    def _dp_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The data-parallel group of this rank among ``ranks``: all of them, or under
        megatron TP the ones of this rank's TP index (TP groups: consecutive ranks)."""
        tp = self.profile.trainer.tensor_parallel
        if tp == 1 or len(ranks) == 1:
            return self._group(ranks)
        return self.dp_groups[tuple(r for r in sorted(ranks) if r % tp == self.rank % tp)]

    def _send(self, msg: StepDone | StepFailed) -> None:
        raise NotImplementedError

    def _needs_ref(self, role: Role) -> bool:
        if self.profile.trainer.kl_beta == 0:
            return False
        return self.is_sync or role in (Role.REF, Role.ACTOR)

    def _make_ref(self) -> None:
        if self.ref is None:
            model, _ = self._initial_model()
            # the frozen Ref runs on its rank alone (under megatron TP on its TP block): no
            # collective ties it to the actor group
            self.ref = RefWorker(self._backend(model, (self.rank,), trainable=False))

    def _make_actor(self, model: Qwen2ForCausalLM | None,
                    state: dict[str, torch.Tensor] | None) -> None:
        if model is None:
            model, _ = self._initial_model()
        if state is not None:
            load_weights(model, state)
        if isinstance(model, Qwen2VLForCausalLM):
            model.freeze_vision(not self.profile.trainer.train_vision)
        backend = self._backend(model, self.actor_set)
        self.actor = ActorWorker(backend, self.profile.trainer, self.version,
                                 total_steps=self.profile.job.steps)

    @property
    def _rewraps(self) -> bool:
        return backend_class(self.profile.trainer.backend).rewraps

    def _rewrap_actor(self) -> None:
        """The actor set changed: wrap the same module and optimizer for the new group."""
        assert self.actor is not None and self._rewraps
        self.actor.backend = self._backend(self.actor.backend.model, self.actor_set)

    def _backend(self, model: Qwen2ForCausalLM, ranks: tuple[int, ...], *,
                 trainable: bool = True):
        trainer = self.profile.trainer
        return make_backend(trainer.backend, model, self._dp_group(ranks), trainable=trainable,
                            chunk_tokens=trainer.logits_chunk_tokens,
                            activation_checkpointing=trainable
                            and trainer.activation_checkpointing)

    async def _train(self, cmd: TrainStep) -> None:
        """One attempt of a step: StepDone, or StepFailed when it failed (a collective with a
        rank that died) or was aborted; either way the rank goes on to its next command."""
        key = (cmd.step, cmd.attempt)
        stream = self.streams[key]
        try:
            executor = self._executor(cmd)
            if executor is None:  # not in this step's trainer set
                return
            before = self.actor.version if self.actor is not None else None
            try:
                result = await asyncio.to_thread(executor.run_step, stream, stream, time.time())
            except Exception as exc:  # the coordinator settles it with the step's other ranks
                self._step_failed(cmd, before, exc)
                return
        finally:
            if self.streams.get(key) is stream:
                del self.streams[key]
        if result.step is not None:
            self.version = result.step.version
        done = step_done(self.rank, cmd.step, result, stream, self.version, cmd.attempt)
        log.info("rank %d: step %d %s, %d loss tokens, loss %.4f, %.2f s", self.rank, cmd.step,
                 done.mode, done.loss_tokens, done.loss, done.seconds)
        self._send(done)

    def _step_failed(self, cmd: TrainStep, before: int | None, exc: Exception) -> None:
        actor = self.actor
        updated = actor is not None and actor.version != before
        if actor is not None and not updated:
            actor.discard_gradients()
        log.warning("rank %d: step %d (attempt %d) failed%s: %s", self.rank, cmd.step,
                    cmd.attempt, " after its update" if updated else "", exc)
        self._send(StepFailed(rank=self.rank, step=cmd.step, attempt=cmd.attempt,
                              updated=updated, error=f"{exc}"[:500]))

    def _executor(self, cmd: TrainStep) -> DecoupledExecutor | ColocatedExecutor | None:
        """This rank's executor of the step's mode; None when it is not in the step's ranks."""
        if cmd.mode is StepMode.DECOUPLED:
            return self._decoupled_executor(cmd)
        if self.rank not in cmd.actor_ranks:
            return None
        assert self.actor is not None, f"rank {self.rank} has no actor for step {cmd.step}"
        return ColocatedExecutor.for_mode(cmd.mode, self.ref, self.actor,
                                          max_aggregate=cmd.max_aggregate,
                                          group=self.actor.backend.group,
                                          device=self.device)

    def _decoupled_executor(self, cmd: TrainStep) -> DecoupledExecutor | None:
        if self.rank not in cmd.ref_ranks and self.rank not in cmd.actor_ranks:
            return None
        is_ref = self.rank in cmd.ref_ranks
        use_ref = self.profile.trainer.kl_beta > 0  # no KL term: no Ref pass at all
        if is_ref and use_ref:
            self._make_ref()
        group = self.actor.backend.group if self.actor is not None and not is_ref else None
        ranks = tuple(sorted({*cmd.ref_ranks, *cmd.actor_ranks}))
        return DecoupledExecutor(self.rank, cmd.ref_ranks, cmd.actor_ranks,
                                 ref=self.ref if is_ref and use_ref else None,
                                 actor=None if is_ref else self.actor,
                                 actor_group=group, device=self.device, use_ref=use_ref,
                                 p2p_group=self.groups.get(ranks), step=cmd.step,
                                 attempt=cmd.attempt)

    async def _export(self, cmd: SyncWeights, state: dict[str, torch.Tensor]) -> None:
        """The source writes ``hf/step-N`` when the boundary asks (before any rank trains on:
        a DDP source's state is its live weights)."""
        if not cmd.export or self.rank != cmd.src_rank:
            return
        assert self.model_config is not None
        folder = step_dir(cmd.export, cmd.version)
        await asyncio.to_thread(write_folder, state, self.model_config, self.tokenizer, folder,
                                self.profile.trainer.export_shard_mb << 20,
                                self.profile.model.path)
        log.info("rank %d: exported version %d to %s", self.rank, cmd.version, folder)

    def _sync_weights(self, cmd: SyncWeights, with_optimizer: bool,
                      takes_optimizer: bool) -> dict[str, torch.Tensor]:
        """The boundary's collectives, in one order on every rank: the actors gather the
        source's full weights (and AdamW state) where the backend shards them, then the source
        broadcasts them to the members. Returns the weights of ``version``."""
        is_src = self.rank == cmd.src_rank
        # every old actor joins the gather of a sharded backend (FSDP2, megatron under TP)
        gathers = self.actor is not None and self.actor.backend.gathers
        source = optimizer = None
        if gathers or is_src:
            assert self.actor is not None
            source = self.actor.backend.full_state_dict(keep=is_src)
            if with_optimizer:
                optimizer = self.actor.optimizer_state(keep=is_src)
        group = self._group(tuple(cmd.members))
        result = sync_params(source if is_src else None, self.layout,
                             cmd.version if is_src else None, src=cmd.src_rank, group=group,
                             device=self.device)
        if with_optimizer:
            moments = sync_params(optimizer if is_src else None, self.optimizer_layout,
                                  cmd.version if is_src else None, src=cmd.src_rank,
                                  group=group, device=self.device)
            self._joined_optimizer = moments.state if takes_optimizer else None
        return result.state

    def _resume(self, folder: Path) -> None:
        """A resumed job: each actor loads its part of the checkpoint (weights, AdamW state,
        RNG; the LR schedule follows the version). The other ranks get the weights at the
        resumed job's first boundary, broadcast from an actor like any update."""
        if self.actor is None:
            return
        backend = self.actor.backend
        meta = load_checkpoint(folder / backend.checkpoint_part, backend, self.actor.optimizer)
        self.version = self.actor.version = meta.version
        log.info("rank %d: resumed from %s (version %d%s)", self.rank, folder, meta.version,
                 "" if meta.rng_restored else ", RNG not restored: another world size")

    def _save_checkpoint(self, cmd: SyncWeights) -> None:
        assert self.actor is not None
        backend = self.actor.backend  # megatron under TP: a sub-folder per TP index
        save_checkpoint(Path(cmd.checkpoint) / backend.checkpoint_part, backend,
                        self.actor.optimizer, cmd.version, {"step": cmd.version})
