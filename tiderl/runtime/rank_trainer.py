"""A rank's trainer side: its Actor and Ref workers on the trainer backend, the RA2P executor of
each step it trains in, and its part in a boundary (the gather of sharded weights, publishing
or fetching them on the weight feed, the HF export, the checkpoint).

    TrainStep ──open──> StreamedStep (MicroBatchData, StepClosed, AbortStep feed it while the
        step runs) ──train──> the step's executor ──> StepDone | StepFailed
    a boundary ──boundary_weights──> the weights (and, for a new actor, the AdamW state) of the
        version, from the source actor's feed; take_role builds, rewraps or drops the workers

Every collective and fetch here runs in a worker thread (``asyncio.to_thread``), so the rank's
event loop keeps sending heartbeats while a gather or a fetch blocks. A step whose task is
cancelled (the rank stops: SIGTERM) aborts its stream, so that its thread, waiting there for
micro-batches, ends with it: the interpreter's exit joins it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tiderl.core.system import StepMode
from tiderl.core.types import Role
from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.models.qwen2_vl import Qwen2VLForCausalLM
from tiderl.profile import Profile
from tiderl.runtime.bus import (
    AbortStep,
    Message,
    MicroBatchData,
    StepClosed,
    StepFailed,
    SyncWeights,
    TrainStep,
)
from tiderl.runtime.rank_wire import micro_batch_of, step_done
from tiderl.runtime.rank_world import RankWorld
from tiderl.trainer.checkpoint import load_checkpoint, save_checkpoint, step_dir
from tiderl.trainer.executors import ColocatedExecutor, DecoupledExecutor, StreamedStep
from tiderl.trainer.export import write_folder
from tiderl.trainer.parallel import backend_class, make_backend
from tiderl.trainer.sync import load_weights
from tiderl.trainer.weight_feed import OPTIMIZER, WEIGHTS, fetch
from tiderl.trainer.worker import ActorWorker, RefWorker

log = logging.getLogger("tiderl.rank")
HOLD_VAR = "TIDERL_TEST_HOLD_BOUNDARY"  # "<rank>:<version>:<seconds>", see _hold


class TrainerSide:
    def __init__(self, world: RankWorld, profile: Profile, send: Callable[[Message], None],
                 actor_set: tuple[int, ...]) -> None:
        self.world, self.profile, self.send = world, profile, send
        self.rank = world.rank
        self.actor_set = actor_set  # the actors the backend wraps now
        self.actor: ActorWorker | None = None
        self.ref: RefWorker | None = None
        self.streams: dict[tuple[int, int], StreamedStep] = {}  # by (step, attempt)
        self.joined_optimizer: dict[str, torch.Tensor] | None = None  # a new actor's AdamW

    # -- workers ---------------------------------------------------------------------------------

    def needs_ref(self, role: Role, is_sync: bool) -> bool:
        if self.profile.trainer.kl_beta == 0:
            return False
        return is_sync or role in (Role.REF, Role.ACTOR)

    def make_ref(self) -> None:
        if self.ref is None:
            # the frozen Ref runs on its rank alone (under megatron TP on its TP block): no
            # collective ties it to the actor group
            self.ref = RefWorker(self._backend(self.world.model(), (self.rank,),
                                               trainable=False))

    def make_actor(self, model: Qwen2ForCausalLM | None, state: dict[str, torch.Tensor] | None,
                   version: int) -> None:
        """The actor of ``version`` over ``actor_set`` (``state``: its weights; None: the
        model's own); a joining actor then takes the AdamW state it was sent."""
        if model is None:
            model = self.world.model()
        if state is not None:
            load_weights(model, state)
        if isinstance(model, Qwen2VLForCausalLM):
            model.freeze_vision(not self.profile.trainer.train_vision)
        self.actor = ActorWorker(self._backend(model, self.actor_set), self.profile.trainer,
                                 version, total_steps=self.profile.job.steps)
        if self.joined_optimizer is not None:
            self.actor.load_optimizer_state(self.joined_optimizer)

    @property
    def rewraps(self) -> bool:
        """The backend wraps the same module for another actor set (DDP); FSDP2 cannot, and
        every actor of a new set is built afresh (it gets weights and AdamW state, as a joiner
        does)."""
        return backend_class(self.profile.trainer.backend).rewraps

    def rewrap_actor(self) -> None:
        """The actor set changed: wrap the same module and optimizer for the new group."""
        assert self.actor is not None and self.rewraps
        self.actor.backend = self._backend(self.actor.backend.model, self.actor_set)

    def _backend(self, model: Qwen2ForCausalLM, ranks: tuple[int, ...], *,
                 trainable: bool = True):
        trainer = self.profile.trainer
        return make_backend(trainer.backend, model, self.world.dp_group(ranks),
                            trainable=trainable, chunk_tokens=trainer.logits_chunk_tokens,
                            activation_checkpointing=trainable
                            and trainer.activation_checkpointing)

    async def take_role(self, role: Role, actors: tuple[int, ...], version: int,
                        state: dict[str, torch.Tensor] | None, *, is_sync: bool,
                        rebuild: bool) -> None:
        """The workers ``role`` needs over the new actor set. Building a model and wrapping it
        (a collective: DDP syncs it over the group) run in a worker thread, so heartbeats go on
        however long they take on a loaded machine."""
        changed, self.actor_set = actors != self.actor_set, actors
        if role is Role.ACTOR:
            if self.actor is None or rebuild:
                self.actor = None  # the old shards go before the new model is built
                await asyncio.to_thread(self.make_actor, None, state, version)
            elif changed:
                await asyncio.to_thread(self.rewrap_actor)
        else:
            self.actor = None
        self.joined_optimizer = None
        if self.needs_ref(role, is_sync):
            await asyncio.to_thread(self.make_ref)
        else:
            self.ref = None

    # -- steps -----------------------------------------------------------------------------------

    def open_stream(self, cmd: TrainStep) -> None:
        """A step this rank may train in: its stream takes the step's messages from now on."""
        self.streams[(cmd.step, cmd.attempt)] = StreamedStep()
        log.info("rank %d: step %d attempt %d opens", self.rank, cmd.step, cmd.attempt)

    def to_stream(self, msg: MicroBatchData | StepClosed | AbortStep) -> None:
        """Into the step's stream (its TrainStep came first), at once: the step may be what
        runs now. One that ended already (a late message of an attempt a rank died in) takes
        nothing."""
        stream = self.streams.get((msg.step, msg.attempt))
        if stream is None:
            return
        if isinstance(msg, MicroBatchData):
            stream.add(*micro_batch_of(msg))
        elif isinstance(msg, StepClosed):
            stream.close()
        else:
            stream.abort()

    async def train(self, cmd: TrainStep, version: int) -> int:
        """One attempt of a step: StepDone, or StepFailed when it failed (a collective with a
        rank that died) or was aborted; either way the rank goes on to its next command.
        Returns the version this rank then holds."""
        key = (cmd.step, cmd.attempt)
        stream = self.streams[key]
        try:
            executor = self._executor(cmd)
            if executor is None:  # not in this step's trainer set
                return version
            before = self.actor.version if self.actor is not None else None
            try:
                result = await asyncio.to_thread(executor.run_step, stream, stream, time.time())
            except asyncio.CancelledError:  # the rank stops: its thread must not wait on
                stream.abort()  # micro-batches that never come (the exit joins that thread)
                raise
            except Exception as exc:  # the coordinator settles it with the step's other ranks
                self._step_failed(cmd, before, exc)
                return version
        finally:
            if self.streams.get(key) is stream:
                del self.streams[key]
        if result.step is not None:
            version = result.step.version
        done = step_done(self.rank, cmd.step, result, stream, version, cmd.attempt)
        log.info("rank %d: step %d %s, %d loss tokens, loss %.4f, %.2f s", self.rank, cmd.step,
                 done.step_mode, done.loss_tokens, done.loss, done.seconds)
        self.send(done)
        return version

    def _step_failed(self, cmd: TrainStep, before: int | None, exc: Exception) -> None:
        actor = self.actor
        updated = actor is not None and actor.version != before
        if actor is not None and not updated:
            actor.discard_gradients()
        log.warning("rank %d: step %d (attempt %d) failed%s: %s", self.rank, cmd.step,
                    cmd.attempt, " after its update" if updated else "", exc)
        self.send(StepFailed(rank=self.rank, step=cmd.step, attempt=cmd.attempt,
                             updated=updated, error=f"{exc}"[:500]))

    def _executor(self, cmd: TrainStep) -> DecoupledExecutor | ColocatedExecutor | None:
        """This rank's executor of the step's mode; None when it is not in the step's ranks."""
        if cmd.step_mode is StepMode.DECOUPLED:
            return self._decoupled_executor(cmd)
        if self.rank not in cmd.actor_ranks:
            return None
        assert self.actor is not None, f"rank {self.rank} has no actor for step {cmd.step}"
        return ColocatedExecutor.for_step_mode(cmd.step_mode, self.ref, self.actor,
                                          max_aggregate=cmd.max_aggregate,
                                          group=self.actor.backend.group,
                                          device=self.world.device)

    def _decoupled_executor(self, cmd: TrainStep) -> DecoupledExecutor | None:
        if self.rank not in cmd.ref_ranks and self.rank not in cmd.actor_ranks:
            return None
        is_ref = self.rank in cmd.ref_ranks
        use_ref = self.profile.trainer.kl_beta > 0  # no KL term: no Ref pass at all
        if is_ref and use_ref:
            self.make_ref()
        group = self.actor.backend.group if self.actor is not None and not is_ref else None
        ranks = tuple(sorted({*cmd.ref_ranks, *cmd.actor_ranks}))
        return DecoupledExecutor(self.rank, cmd.ref_ranks, cmd.actor_ranks,
                                 ref=self.ref if is_ref and use_ref else None,
                                 actor=None if is_ref else self.actor,
                                 actor_group=group, device=self.world.device, use_ref=use_ref,
                                 p2p_group=self.world.groups.get(ranks), step=cmd.step,
                                 attempt=cmd.attempt)

    # -- the boundary's weights --------------------------------------------------------------

    def boundary_weights(self, cmd: SyncWeights, with_optimizer: bool, fetches: bool,
                         takes_optimizer: bool, cancel: Callable[[], bool]
                         ) -> dict[str, torch.Tensor] | None:
        """The weights of ``cmd.version`` on this rank. The actors gather them (and the AdamW
        state, ``with_optimizer``) where the backend shards them, a collective of the old
        actors; the source publishes them on its feed and goes on. A rank that ``fetches``
        gets them from the source's feed, on a connection of its own, and with
        ``takes_optimizer`` the AdamW state too; every other rank gets None."""
        kit, is_src = self.world.kit, self.rank == cmd.src_rank
        assert kit is not None and self.world.feed is not None
        gathers = self.actor is not None and self.actor.backend.gathers
        if gathers or is_src:
            assert self.actor is not None
            source = self.actor.backend.full_state_dict(keep=is_src)
            optimizer = self.actor.optimizer_state(keep=is_src) if with_optimizer else None
            if is_src:
                _hold(self.rank, cmd.version)
                parts = {WEIGHTS: (kit.weights, source)}
                if optimizer is not None:
                    parts[OPTIMIZER] = (kit.optimizer, optimizer)
                self.world.feed.publish(cmd.version, parts)
                self.joined_optimizer = optimizer if takes_optimizer else None
                return source
        if not fetches:
            return None
        log.info("rank %d: fetching version %d from %s", self.rank, cmd.version, cmd.source)
        stall_s = self.profile.runtime.collective_timeout_s
        get = functools.partial(fetch, cmd.source, cmd.version, token=self.world.feed_token,
                                cancel=cancel, stall_s=stall_s, device=self.world.device)
        state = get(kit.weights, WEIGHTS)
        if takes_optimizer:
            self.joined_optimizer = get(kit.optimizer, OPTIMIZER)
        return state

    async def export(self, cmd: SyncWeights, state: dict[str, torch.Tensor]) -> None:
        """The source writes ``hf/step-N`` when the boundary asks (before any rank trains on:
        a DDP source's state is its live weights)."""
        if not cmd.export or self.rank != cmd.src_rank:
            return
        kit = self.world.kit
        assert kit is not None
        folder = step_dir(cmd.export, cmd.version)
        await asyncio.to_thread(write_folder, state, kit.config, kit.tokenizer, folder,
                                self.profile.trainer.export_shard_mb << 20,
                                self.profile.model.path)
        log.info("rank %d: exported version %d to %s", self.rank, cmd.version, folder)

    async def save_checkpoint(self, cmd: SyncWeights) -> None:
        """The live actors save the checkpoint together, a collective over their group: an
        actor that died since the last step leaves the boundary's members, and the others
        (DDP: each holds the whole state) first wrap their model for the group without it."""
        assert self.actor is not None
        live = tuple(r for r in self.actor_set if r in cmd.members)
        if live != self.actor_set and self.rewraps:
            self.actor_set = live
            await asyncio.to_thread(self.rewrap_actor)
        backend = self.actor.backend  # megatron under TP: a sub-folder per TP index
        await asyncio.to_thread(save_checkpoint, Path(cmd.checkpoint) / backend.checkpoint_part,
                                backend, self.actor.optimizer, cmd.version,
                                {"step": cmd.version})

    def resume(self, folder: Path) -> int | None:
        """A resumed job: the actor loads its part of the checkpoint (weights, AdamW state,
        RNG; the LR schedule follows the version) and returns that version. The other ranks
        get the weights at the resumed job's first boundary, from an actor's feed like any
        update."""
        if self.actor is None:
            return None
        backend = self.actor.backend
        meta = load_checkpoint(folder / backend.checkpoint_part, backend, self.actor.optimizer)
        self.actor.version = meta.version
        log.info("rank %d: resumed from %s (version %d%s)", self.rank, folder, meta.version,
                 "" if meta.rng_restored else ", RNG not restored: another world size")
        return meta.version


def _hold(rank: int, version: int) -> None:
    """The chaos tests' window: with ``TIDERL_TEST_HOLD_BOUNDARY=<rank>:<version>:<seconds>``
    set, that rank waits before it publishes that version as its source, so the receivers are
    inside their fetch for that long (a test kills a rank there, deterministically)."""
    held = os.environ.get(HOLD_VAR, "").split(":")
    if len(held) == 3 and (int(held[0]), int(held[1])) == (rank, version):
        log.info("rank %d: holding version %d for %s s (%s)", rank, version, held[2], HOLD_VAR)
        time.sleep(float(held[2]))
