"""The rank daemon: one process per rank (device), in any role the coordinator gives it.

    bus (DEALER) ──AdmitTask / PauseTask / ResumeTask / DetachTask──> RolloutSide: agent loops
                     on the engine ──TurnReport, TaskFinished, TaskDetached──> bus
                 ──SyncWeights, TrainStep──> one command at a time: the boundary (the role
                     switch and the weights from the source's feed), a step (TrainerSide's
                     RA2P executor)
                 ──MicroBatchData / StepClosed / AbortStep──> the open step's stream at once
    every heartbeat_s: Heartbeat and RankMetrics (the engine's KV and prefix counters)

The daemon is short: its parts own their state and it composes them at a boundary.

    RankWorld     the torch.distributed world and its groups, the model's builder and layouts
    RolloutSide   the engine (in-process, or this rank's server), agent loops, held weights
    TrainerSide   Actor and Ref workers, each step's executor, the boundary's collectives

All ranks form one ``torch.distributed`` world (gloo on CPU, NCCL on GPU) and create the trainer
process groups of :mod:`tiderl.core.rank_sets` at start-up. Roles:

- ``rollout``: its engine plus one agent loop per admitted task against the environment
  service; pins each task's KV between turns when CTB asks (``AdmitTask.pin``) and the engine
  can.
- ``actor``: the policy (DDP over the actor set) with AdamW, and a frozen Ref copy for the
  colocated modes (swapped on a GPU).
- ``ref``: the frozen Ref model only (the decoupled mode's dedicated rank).
- ``sync`` mode: every rank is a rollout rank and an actor at once (verl's hybrid engine): it
  rolls out, then trains, then loads its own new weights into its engine.

At the boundary (``SyncWeights``) every rank takes its new role; the source actor publishes the
new weights on its feed and each rank that needs them fetches them on a connection of its own
(tiderl.trainer.weight_feed: no rank waits on another): a leaving rollout rank detaches its tasks
(they go on elsewhere from their carry) and drops its engine; a rollout rank, new or not, fetches
the weights for its engine; a new actor fetches the weights and the optimizer state; a new Ref
loads the initial weights locally. A newer SyncWeights (the source died: the boundary went out
again from another actor) ends a fetch in flight. While an
evaluation task runs on a rollout rank its engine keeps the anchored version: new weights wait
until the evaluation tasks there are done (paper §3.2).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import torch

from tiderl.core.types import Role
from tiderl.env.client import HTTPEnvClient
from tiderl.profile import Profile
from tiderl.runtime.bus import (
    AbortStep,
    Ack,
    AdmitTask,
    BusClient,
    DetachTask,
    Heartbeat,
    Hello,
    Message,
    MicroBatchData,
    PauseTask,
    ResumeTask,
    Shutdown,
    StepClosed,
    SyncWeights,
    TrainStep,
    load_job_keys,
    rank_identity,
)
from tiderl.runtime.rank_engines import EmbeddedEngine
from tiderl.runtime.rank_rollout import RolloutSide
from tiderl.runtime.rank_trainer import TrainerSide
from tiderl.runtime.rank_world import RankArgs, RankWorld, ranks_with
from tiderl.runtime.resume import resume_request
from tiderl.runtime.step_config import profile_step_config
from tiderl.trainer.parallel import prepare_actor_imports

log = logging.getLogger("tiderl.rank")

FALLBACK_POLL_S = 0.05  # the bus reader is edge-triggered: a slow poll catches a missed edge
COORDINATOR_LOST_S = 15.0  # at least: a rank exits when its coordinator is gone this long
EXIT_COORDINATOR_LOST = 3
STEERING = {PauseTask: "pause", ResumeTask: "resume", DetachTask: "detach"}

__all__ = ["BusLink", "RankArgs", "RankDaemon"]


class BusLink:
    """The rank's connection to its coordinator: a DEALER socket once :meth:`open` made it
    (every part sends through ``send``)."""

    def __init__(self) -> None:
        self.client: BusClient | None = None

    def open(self, args: RankArgs) -> BusClient:
        keys = load_job_keys(args.run_dir / "keys", args.rank)
        self.client = BusClient(args.bus, keys, rank_identity(args.rank))
        return self.client

    def send(self, msg: Message) -> None:
        assert self.client is not None, "the bus is not open"
        self.client.send(msg)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class RankDaemon:
    def __init__(self, args: RankArgs, profile: Profile):
        self.args, self.profile = args, profile
        self.rank = args.rank
        self.is_sync = profile.runtime.system == "sync"
        self.role = args.role
        self.version = 0
        self.world = RankWorld(args, profile)
        env = HTTPEnvClient(args.env_url, owner=rank_identity(self.rank).decode(),
                            timeout_s=profile.env.request_timeout_s,
                            deadline_s=profile.env.call_deadline_s) if args.env_url else None
        self.link = BusLink()
        self.rollout = RolloutSide(self.world, profile, self._send, env)
        self.trainer = TrainerSide(self.world, profile, self._send, ())
        self.commands: asyncio.Queue = asyncio.Queue()  # boundaries, steps, anchored admits
        self.latest_boundary = 0  # the seq of the newest SyncWeights received
        self.stopping: asyncio.Event | None = None

    # -- start-up --------------------------------------------------------------------------------

    def setup(self, initial_roles: list[Role]) -> None:
        """Join the world, create every trainer group, build this role's models."""
        self.world.join(initial_roles, self.is_sync)
        # a rank with an engine server that starts in rollout needs the model only for its
        # shapes (and the server needs the device's memory): on the CPU
        uses_server = self.profile.engine.uses_server
        on_server = uses_server and self.role is Role.ROLLOUT and not self.is_sync
        model, tokenizer = self.world.initial(torch.device("cpu") if on_server else None)
        self.world.describe(model, tokenizer)
        self.trainer.actor_set = ranks_with(initial_roles, Role.ACTOR, self.is_sync)
        if uses_server:
            self.rollout.open_server()
        elif self.is_sync or self.role is Role.ROLLOUT:
            self.rollout.attach(EmbeddedEngine(model, self.profile.engine, 0,
                                               model_folder=self.profile.model.path or None))
            model = None
        if self.is_sync or self.role is Role.ACTOR:
            self.trainer.make_actor(model, None, self.version)
        elif profile_step_config(self.profile).has_ers:
            prepare_actor_imports()
        if self.trainer.needs_ref(self.role, self.is_sync):
            self.trainer.make_ref()
        resume = resume_request(self.args.run_dir)
        if resume is not None:
            version = self.trainer.resume(resume)
            self.version = self.version if version is None else version

    # -- the event loop --------------------------------------------------------------------------

    async def run(self) -> None:
        if self.rollout.server is not None:  # before Hello: it serves version 0, or sleeps
            await self.rollout.wait_server(self.is_sync or self.role is Role.ROLLOUT)
        bus = self.link.open(self.args)
        self.stopping = asyncio.Event()
        device = self.world.device
        self._send(Hello(rank=self.rank, pid=os.getpid(), host=socket.gethostname(),
                         role=self.role.value, device=str(device),
                         feed=self.world.feed_address))
        log.info("rank %d up: %s on %s, bus %s, pid %d", self.rank, self.role.value, device,
                 self.args.bus, os.getpid())
        loop = asyncio.get_running_loop()
        loop.add_reader(bus.fileno(), self._drain)
        workers = [asyncio.create_task(self._heartbeats()),
                   asyncio.create_task(self._fallback_poll()),
                   asyncio.create_task(self._run_commands())]
        try:
            await self.stopping.wait()
        finally:
            loop.remove_reader(bus.fileno())
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            await self.rollout.close()
            self.world.close()
            self.link.close()

    def _send(self, msg: Message) -> None:
        self.link.send(msg)

    async def _heartbeats(self) -> None:
        rt = self.profile.runtime
        lost_after = max(COORDINATOR_LOST_S, 2 * rt.heartbeat_s * (rt.heartbeat_misses + 1))
        while True:
            self._send(Heartbeat(rank=self.rank, sent_at=time.time()))
            self._send(await self.rollout.metrics(self.role.value))
            assert self.link.client is not None
            down = self.link.client.down_for()
            if down > lost_after:  # the job is over for this rank: do not spin reconnecting
                log.error("rank %d: no bus connection to the coordinator for %.0f s; exiting",
                          self.rank, down)
                logging.shutdown()
                os._exit(EXIT_COORDINATOR_LOST)  # a worker may be blocked in a collective
            await asyncio.sleep(rt.heartbeat_s)

    async def _fallback_poll(self) -> None:
        while True:
            await asyncio.sleep(FALLBACK_POLL_S)
            self._drain()

    def _drain(self) -> None:
        assert self.link.client is not None
        while (msg := self.link.client.recv(0)) is not None:
            self._handle(msg)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, AdmitTask) and msg.eval:  # after any weight sync before it: anchored
            self.commands.put_nowait(msg)
        elif isinstance(msg, AdmitTask):
            self.rollout.admit(msg)
        elif isinstance(msg, PauseTask | ResumeTask | DetachTask):
            self.rollout.steer(msg.task_id, STEERING[type(msg)])
        elif isinstance(msg, TrainStep):
            self.trainer.open_stream(msg)
            self.commands.put_nowait(msg)
        elif isinstance(msg, MicroBatchData | StepClosed | AbortStep):
            self.trainer.to_stream(msg)
        elif isinstance(msg, SyncWeights | Shutdown):  # in order: a boundary, the last save
            if isinstance(msg, SyncWeights):  # sent again (its source died): leave a fetch
                self.latest_boundary = msg.seq
            self.commands.put_nowait(msg)
        else:
            log.warning("rank %d: ignored a %s", self.rank, type(msg).__name__)

    async def _run_commands(self) -> None:
        while True:
            cmd = await self.commands.get()
            try:
                if isinstance(cmd, TrainStep):
                    await self.train(cmd)
                elif isinstance(cmd, AdmitTask):
                    self.rollout.admit(cmd)
                elif isinstance(cmd, Shutdown):
                    log.info("rank %d: shutdown (%s)", self.rank, cmd.reason)
                    assert self.stopping is not None
                    self.stopping.set()
                    return
                else:
                    await self._boundary(cmd)
            except Exception as exc:
                log.exception("rank %d: %s failed", self.rank, type(cmd).__name__)
                self._send(Ack(rank=self.rank, ref=cmd.seq, ok=False, error=f"{exc}"[:500]))
                if not isinstance(cmd, SyncWeights):
                    raise
                # its source died (the boundary comes again from another actor) or a real
                # error (the job stops): this rank's role is unchanged until one succeeds

    async def train(self, cmd: TrainStep) -> None:
        """This rank's part of one attempt of a step (its stream opened when the TrainStep
        came)."""
        self.version = await self.trainer.train(cmd, self.version)

    # -- the boundary ----------------------------------------------------------------------------

    async def _boundary(self, cmd: SyncWeights) -> None:
        roles = [Role(r) for r in cmd.roles]
        new = roles[self.rank]
        new_actors = ranks_with(roles, Role.ACTOR, self.is_sync)
        trainer = self.trainer
        if self.is_sync:
            await self._sync_boundary(cmd, new_actors)
            return
        if self.role is Role.ROLLOUT and new is not Role.ROLLOUT and self.rollout.is_rolling_out:
            await self.rollout.leave()  # (not again when a failed boundary is sent again)
        if cmd.checkpoint and self.role is Role.ACTOR:
            await trainer.save_checkpoint(cmd)
        # a backend that cannot wrap its module for another group (FSDP2) builds every actor of
        # a new actor set afresh: each gets the weights and the optimizer state, as a joiner does
        rebuilt = () if trainer.rewraps or new_actors == trainer.actor_set else new_actors
        joiners = set(cmd.joiners) | set(rebuilt)  # they take the AdamW state too
        state = None
        if cmd.version > 0:
            fetches = new is Role.ROLLOUT or self.rank in joiners
            state = await asyncio.to_thread(
                trainer.boundary_weights, cmd, bool(joiners), fetches, self.rank in joiners,
                lambda: self.latest_boundary > cmd.seq)
            if state is not None:
                await trainer.export(cmd, state)
        self.version = cmd.version
        if new is Role.ROLLOUT:
            if not self.rollout.is_rolling_out:
                await self.rollout.join(self.version, state)
            elif state is not None:
                await self.rollout.take_weights(state, self.version)
        await trainer.take_role(new, new_actors, self.version, state, is_sync=False,
                                rebuild=self.rank in rebuilt)
        if new is not self.role:
            log.info("rank %d: %s -> %s at version %d", self.rank, self.role.value, new.value,
                     self.version)
            if self.world.device is not None and self.world.device.type == "cuda":
                torch.cuda.empty_cache()  # what the old role held goes back to the device
        self.role = new
        self._send(Ack(rank=self.rank, ref=cmd.seq, ok=True))

    async def _sync_boundary(self, cmd: SyncWeights, actors: tuple[int, ...]) -> None:
        """Every rank trained the same update: its engine takes its own weights, and a rank
        that died leaves the others training on without it."""
        trainer = self.trainer
        if cmd.version > 0:
            assert trainer.actor is not None and self.rollout.is_rolling_out
            state = await asyncio.to_thread(trainer.actor.backend.full_state_dict)
            await trainer.export(cmd, state)
            await self.rollout.take_weights(state, cmd.version)
        self.version = cmd.version
        if actors != trainer.actor_set:
            trainer.actor_set = actors
            await asyncio.to_thread(trainer.rewrap_actor)
        self._send(Ack(rank=self.rank, ref=cmd.seq, ok=True))
