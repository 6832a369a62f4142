"""The rank daemon: one process per rank (device), in any role the coordinator gives it.

    bus (DEALER) ──AdmitTask / PauseTask / ResumeTask──> agent loops on the engine ──TurnReport,
                                                                                 TaskFinished──> bus
                 ──SyncWeights, TrainStep──> one command at a time, in a worker thread:
                                             role switch + weight broadcast, RA2P step
                 ──MicroBatchData / StepClosed──> the open step's StreamedStep (fed while it runs)
                 ──AbortStep──> that StreamedStep aborted: the step's executor stops

All ranks form one ``torch.distributed`` world (gloo on CPU, NCCL on GPU) and create the trainer
process groups of :mod:`tiderl.core.rank_sets` at start-up. Roles:

- ``rollout``: its engine (in-process, or its own engine server: ``tiderl/runtime/engines.py``)
  plus one agent loop per admitted task against the environment service; pins each task's KV
  between turns when CTB asks (``AdmitTask.pin``) and the engine can.
- ``actor``: the policy (DDP over the actor set) with AdamW, and a frozen Ref copy for the
  colocated modes (swapped on a GPU).
- ``ref``: the frozen Ref model only (the decoupled mode's dedicated rank).
- ``sync`` mode: every rank is a rollout rank and an actor at once (verl's hybrid engine): it
  rolls out, then trains, then loads its own new weights into its engine.

At the post-update boundary (``SyncWeights``) every rank takes its new role and joins the weight
broadcast from the source actor: a leaving rollout rank detaches its tasks (they go on elsewhere
from their carry) and drops its engine; a new rollout rank builds its engine from the broadcast;
a new actor gets the weights and the optimizer state; a new Ref loads the initial weights
locally. While an evaluation task runs on a rollout rank its engine keeps the anchored version:
new weights wait until the evaluation tasks there are done (paper §3.2).

The trainer side (workers, executors, the boundary's collectives) is in
:mod:`tiderl.runtime.rank_trainer`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from tiderl.core.rank_sets import trainer_sets
from tiderl.core.types import Role, Trajectory
from tiderl.engine.clients import server_client
from tiderl.engine.request import SamplingParams
from tiderl.engine.scheduler import eos_set
from tiderl.env.client import HTTPEnvClient
from tiderl.models.chat import TurnEncoder, turn_encoder
from tiderl.models.image_turns import ImagePlacer, image_placer
from tiderl.models.loading import model_from_config
from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.profile import Profile
from tiderl.runtime.agent import (
    AgentLoop,
    AgentTask,
    EngineUnreachableError,
    TaskCarry,
    TaskDetachedError,
    TurnEvent,
)
from tiderl.runtime.bus import (
    AbortStep,
    Ack,
    AdmitTask,
    BusClient,
    DetachTask,
    Heartbeat,
    Hello,
    MicroBatchData,
    PauseTask,
    RankMetrics,
    ResumeTask,
    Shutdown,
    StepClosed,
    SyncWeights,
    TaskDetached,
    TaskFinished,
    TrainStep,
    TurnReport,
    load_job_keys,
    rank_identity,
)
from tiderl.runtime.engines import EmbeddedEngine, EngineStats, RankEngine, ServerEngine
from tiderl.runtime.rank_trainer import TrainerRoles
from tiderl.runtime.rank_wire import carry_data, carry_of, micro_batch_of
from tiderl.runtime.resume import resume_request
from tiderl.runtime.rollout_log import RolloutLog
from tiderl.runtime.trajectory_wire import turn_data
from tiderl.trainer.executors import (
    StreamedStep,
)
from tiderl.trainer.spawn import init_rank
from tiderl.trainer.sync import param_layout
from tiderl.trainer.worker import ActorWorker, RefWorker, optimizer_layout

log = logging.getLogger("tiderl.rank")

FALLBACK_POLL_S = 0.05
COORDINATOR_LOST_S = 15.0  # at least: a rank exits when its coordinator is gone this long
EXIT_COORDINATOR_LOST = 3
EXIT_ENGINE_LOST = 4
ENGINE_STALL_FACTOR = 2  # a server silent this many heartbeat windows has stalled (SIGSTOP)
IDLE_SAMPLE_S = 0.05  # the bus reader is edge-triggered: a slow poll catches a missed edge


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


class RankDaemon(TrainerRoles):
    def __init__(self, args: RankArgs, profile: Profile):
        self.args, self.profile = args, profile
        self.rank = args.rank
        self.is_sync = profile.runtime.mode == "sync"
        self.role = args.role
        self.version = 0
        self.device = torch.device(args.device)
        self.tokenizer = None
        self.encoder: TurnEncoder | None = None
        self.placer: ImagePlacer | None = None  # a model that reads images
        self.rollout_log = RolloutLog(args.run_dir, self.rank)  # logging.rollouts
        self.layout = None  # weight-sync layout (every rank builds the same model)
        self.optimizer_layout = None  # optimizer-state sync layout, from the same model
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.dp_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # megatron TP > 1
        self.actor_set: tuple[int, ...] = ()
        self.actor: ActorWorker | None = None
        self.ref: RefWorker | None = None
        self.engine: RankEngine | None = None  # while rolling out
        self.server: ServerEngine | None = None  # this rank's engine server, awake or asleep
        self.engine_answered_at = 0.0  # when its engine last answered a heartbeat's stats
        self.model_config = None
        self.agent: AgentLoop | None = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.eval_tasks: set[str] = set()
        self.pending_weights: tuple[dict[str, torch.Tensor], int] | None = None
        self._joined_optimizer: dict[str, torch.Tensor] | None = None
        self.queries_before = self.hits_before = 0  # prefix counters of engines dropped earlier
        self.streams: dict[tuple[int, int], StreamedStep] = {}  # by (step, attempt)
        self.commands: asyncio.Queue = asyncio.Queue()
        self._updating = asyncio.Lock()  # engine weight updates, one at a time
        self.bus: BusClient | None = None
        self.env = HTTPEnvClient(args.env_url, owner=rank_identity(self.rank).decode(),
                                 timeout_s=profile.env.request_timeout_s,
                                 deadline_s=profile.env.call_deadline_s) \
            if args.env_url else None
        self._stopping: asyncio.Event | None = None

    # -- start-up --------------------------------------------------------------------------------

    def setup(self, initial_roles: list[Role]) -> None:
        """Join the world, create every trainer group, build this role's models."""
        ctx = init_rank(self.rank, self.args.world_size, self.args.dist_init,
                        device=self.args.device, threads=self.args.threads)
        self.device = ctx.device
        # a member that dies mid-collective can leave the others blocked (gloo does not always
        # see the closed connection): bounded, the broadcast fails and is sent again without it
        timeout = timedelta(seconds=self.profile.runtime.collective_timeout_s)
        for ranks in trainer_sets(self.args.world_size):
            group = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                self.groups[ranks] = group
        if self.profile.trainer.backend == "megatron":  # collectives over the world, at set-up
            from tiderl.trainer.megatron import init_model_parallel

            tp = self.profile.trainer.tensor_parallel
            init_model_parallel(self.profile.model.seed, tp)
            # the data-parallel groups of the (fixed) actor set: the actors of one TP index
            actors = _ranks_with(initial_roles, Role.ACTOR, self.is_sync)
            for index in range(tp if tp > 1 else 0):
                ranks = tuple(r for r in actors if r % tp == index)
                group = dist.new_group(list(ranks), timeout=timeout)
                if self.rank in ranks:
                    self.dp_groups[ranks] = group
        # a rank with an engine server that starts in rollout needs the model only for its
        # shapes (and the server needs the device's memory): on the CPU
        on_server = self.profile.engine.uses_server and self.role is Role.ROLLOUT \
            and not self.is_sync
        model, self.tokenizer = self._initial_model(torch.device("cpu") if on_server else None)
        self.model_config = model.config
        # before the job starts: a chat template needs transformers (seconds to import), and
        # any rank may roll out once ERS moves it
        self.encoder = turn_encoder(self.profile.model.path or None, self.tokenizer,
                                    eos_set(model.config.eos_token_id),
                                    self.profile.model.chat_template)
        self.placer = image_placer(self.profile.model.path or None, model.config,
                                   self.encoder)
        self.layout = param_layout(model)
        self.optimizer_layout = optimizer_layout(model)
        self.actor_set = _ranks_with(initial_roles, Role.ACTOR, self.is_sync)
        if self.profile.engine.uses_server:
            engine = self.profile.engine
            client = server_client(engine.backend, self.args.engine_url,
                                   flush_on_update=engine.kv_on_update == "flush")
            self.server = ServerEngine(client, self.profile.engine,
                                       self.args.run_dir / "weights", model.config,
                                       self.tokenizer, self.profile.model.path)
        elif self.is_sync or self.role is Role.ROLLOUT:
            self._attach(EmbeddedEngine(model, self.profile.engine, 0,
                                        model_folder=self.profile.model.path or None))
            model = None
        if self.is_sync or self.role is Role.ACTOR:
            self._make_actor(model, None)
            model = None
        if self._needs_ref(self.role):
            self._make_ref()
        resume = resume_request(self.args.run_dir)
        if resume is not None:
            self._resume(resume)

    def _initial_model(self, device: torch.device | None = None
                       ) -> tuple[Qwen2ForCausalLM, object]:
        return model_from_config(self.profile.model, device or self.device)

    def _group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        return self.groups[tuple(sorted(ranks))]

    async def _start_engine(self, version: int,
                            state: dict[str, torch.Tensor] | None = None) -> None:
        """Join rollout serving ``version`` (``state``: its weights, None for the initial
        ones): build the in-process engine, or wake this rank's server with them."""
        if self.server is not None:
            if state is None:  # the initial weights: the model folder, or the seeded model's
                path = self.profile.model.path
                state = (Path(path) if path
                         else self._initial_model(torch.device("cpu"))[0].state_dict())
            await self.server.start(version, state)
            self._attach(self.server)
            return
        model, _ = await asyncio.to_thread(self._initial_model)
        self._attach(EmbeddedEngine(model, self.profile.engine, version, state,
                                    self.profile.model.path or None))

    def _attach(self, engine: RankEngine) -> None:
        self.engine = engine
        self.engine_answered_at = time.monotonic()  # up: it answered its health check
        engine_cfg, env_cfg = self.profile.engine, self.profile.env
        sampling = SamplingParams(max_tokens=engine_cfg.max_new_tokens,
                                  temperature=engine_cfg.temperature, top_p=engine_cfg.top_p)
        assert self.model_config is not None and self.encoder is not None
        self.agent = AgentLoop(engine.client, self.env, self.encoder, sampling,
                               record=self.profile.logging.rollouts,
                               max_turns=env_cfg.max_turns,
                               max_context_tokens=min(engine_cfg.kv_cache_tokens,
                                                      self.model_config.max_position_embeddings),
                               version=lambda: engine.version, on_turn=self._on_turn,
                               placer=self.placer, image_window=env_cfg.image_window)

    # -- the event loop --------------------------------------------------------------------------

    async def run(self) -> None:
        if self.server is not None:  # before Hello: it serves version 0, or sleeps meanwhile
            serving = self.is_sync or self.role is Role.ROLLOUT
            await self.server.wait_up(serving)
            if serving:
                self._attach(self.server)
        keys = load_job_keys(self.args.run_dir / "keys", self.rank)
        self.bus = BusClient(self.args.bus, keys, rank_identity(self.rank))
        self._stopping = asyncio.Event()
        self._send(Hello(rank=self.rank, pid=os.getpid(), host=socket.gethostname(),
                         role=self.role.value, device=str(self.device)))
        log.info("rank %d up: %s on %s, bus %s, pid %d", self.rank, self.role.value,
                 self.device, self.args.bus, os.getpid())
        loop = asyncio.get_running_loop()
        loop.add_reader(self.bus.fileno(), self._drain)
        workers = [asyncio.create_task(self._heartbeats()),
                   asyncio.create_task(self._fallback_poll()),
                   asyncio.create_task(self._run_commands())]
        try:
            await self._stopping.wait()
        finally:
            loop.remove_reader(self.bus.fileno())
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            if self.engine is not None:
                await self.engine.close()
            if self.server is not None and self.server is not self.engine:
                await self.server.close()
            if self.env is not None:
                await self.env.close()
            self.bus.close()

    def _send(self, msg) -> None:
        assert self.bus is not None
        self.bus.send(msg)

    async def _heartbeats(self) -> None:
        rt = self.profile.runtime
        lost_after = max(COORDINATOR_LOST_S, 2 * rt.heartbeat_s * (rt.heartbeat_misses + 1))
        while True:
            self._send(Heartbeat(rank=self.rank, sent_at=time.time()))
            self._send(await self._metrics())
            assert self.bus is not None
            down = self.bus.down_for()
            if down > lost_after:  # the job is over for this rank: do not spin reconnecting
                log.error("rank %d: no bus connection to the coordinator for %.0f s; exiting",
                          self.rank, down)
                logging.shutdown()
                os._exit(EXIT_COORDINATOR_LOST)  # a worker may be blocked in a collective
            await asyncio.sleep(rt.heartbeat_s)

    async def _metrics(self) -> RankMetrics:
        stats, engine = EngineStats(), self.engine
        if engine is not None:
            try:  # bounded: a slow server must not hold back the next heartbeat
                stats = await asyncio.wait_for(engine.stats(), self.profile.runtime.heartbeat_s)
                self.engine_answered_at = time.monotonic()
            except Exception as exc:  # a server that does not answer: this beat has no stats
                log.warning("rank %d: engine stats: %s", self.rank, exc or type(exc).__name__)
                if isinstance(exc, asyncio.TimeoutError | httpx.TransportError):
                    self._check_stalled(engine)
            if self.engine is not engine:  # it left rollout meanwhile: its stint is counted
                stats = EngineStats()
        queries, hits = stats.prefix_queries, stats.prefix_hits
        return RankMetrics(rank=self.rank, role=self.role.value,
                           kv_tokens_used=stats.used_tokens,
                           kv_tokens_capacity=stats.capacity_tokens,
                           prefix_hit_rate=hits / queries if queries else 0.0,
                           running=stats.running, waiting=stats.waiting,
                           prefix_queries=self.queries_before + queries,
                           prefix_hits=self.hits_before + hits)

    def _check_stalled(self, engine: RankEngine) -> None:
        """An engine server that has answered no heartbeat's stats for ``ENGINE_STALL_FACTOR``
        heartbeat windows (stopped, or wedged) is treated as gone: the rank exits, and its tasks
        go back to CTB, rather than wait out each request's timeout (minutes)."""
        rt = self.profile.runtime
        silent = time.monotonic() - self.engine_answered_at
        if engine is not self.server or \
                silent < ENGINE_STALL_FACTOR * rt.heartbeat_s * rt.heartbeat_misses:
            return
        log.error("rank %d: its engine server has not answered for %.0f s; exiting, so that its "
                  "tasks go back to CTB", self.rank, silent)
        logging.shutdown()
        os._exit(EXIT_ENGINE_LOST)

    async def _fallback_poll(self) -> None:
        while True:
            await asyncio.sleep(FALLBACK_POLL_S)
            self._drain()

    def _drain(self) -> None:
        assert self.bus is not None
        while (msg := self.bus.recv(0)) is not None:
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, AdmitTask) and msg.eval:  # after any weight sync before it: anchored
            self.commands.put_nowait(msg)
        elif isinstance(msg, AdmitTask):
            self._admit(msg)
        elif isinstance(msg, DetachTask):
            if self.agent is not None and msg.task_id in self.tasks:
                self.agent.detach(msg.task_id)
        elif isinstance(msg, PauseTask | ResumeTask):
            if self.agent is not None and msg.task_id in self.tasks:
                (self.agent.pause if isinstance(msg, PauseTask) else self.agent.resume)(msg.task_id)
        elif isinstance(msg, TrainStep):
            self.streams[(msg.step, msg.attempt)] = StreamedStep()
            self.commands.put_nowait(msg)
        elif isinstance(msg, MicroBatchData | StepClosed | AbortStep):
            self._to_stream(msg)
        elif isinstance(msg, SyncWeights | Shutdown):  # in order: a boundary, the last save
            self.commands.put_nowait(msg)
        else:
            log.warning("rank %d: ignored a %s", self.rank, type(msg).__name__)

    # -- rollout ---------------------------------------------------------------------------------

    def _admit(self, msg: AdmitTask) -> None:
        if self.agent is None:
            self._send(Ack(rank=self.rank, ref=msg.seq, ok=False,
                           error=f"rank {self.rank} is not a rollout rank"))
            return
        task = AgentTask(msg.task_id, msg.group_id, msg.env, msg.task or None, msg.seed, msg.eval)
        carry = None if msg.carry is None else carry_of(msg.carry)
        if msg.eval:
            self.eval_tasks.add(msg.task_id)
        self.agent.pin = msg.pin and self.agent.engine.supports_pins
        self.tasks[msg.task_id] = asyncio.create_task(self._play(task, carry))

    async def _play(self, task: AgentTask, carry: TaskCarry | None) -> None:
        assert self.agent is not None
        try:
            trajectory = await self.agent.run(task, carry)
        except TaskDetachedError as exc:
            self._send(TaskDetached(rank=self.rank, task_id=task.task_id,
                                    carry=carry_data(exc.carry)))
        except asyncio.CancelledError:
            raise
        except EngineUnreachableError as exc:  # the rank cannot roll out: it goes, its tasks
            log.error("rank %d: %s; exiting, so that its tasks go back to CTB", self.rank, exc)
            logging.shutdown()
            os._exit(EXIT_ENGINE_LOST)
        except Exception as exc:  # an environment or engine failure ends the task with reward 0
            log.warning("rank %d: task %s failed: %s", self.rank, task.task_id, exc)
            self._finish(task, Trajectory(task.task_id, task.group_id, reward=0.0),
                         error=f"{type(exc).__name__}: {exc}"[:500])
        else:
            self._finish(task, trajectory)
        finally:
            self.tasks.pop(task.task_id, None)
            self.eval_tasks.discard(task.task_id)
            try:  # weights held back by this rank's last evaluation task
                await self._apply_pending_weights()
            except Exception:
                log.exception("rank %d: loading held-back weights failed", self.rank)

    def _finish(self, task: AgentTask, trajectory: Trajectory, error: str = "") -> None:
        self._send(TaskFinished(rank=self.rank, task_id=task.task_id, group_id=task.group_id,
                                error=error,
                                reward=float(trajectory.reward or 0.0),
                                turns=[turn_data(t) for t in trajectory.turns],
                                num_tokens=trajectory.num_tokens,
                                image_data=trajectory.image_data))
        transcript = self.agent.take_transcript(task.task_id) if self.agent else []
        if self.profile.logging.rollouts:
            self.rollout_log.write(task, trajectory, transcript)

    def _on_turn(self, event: TurnEvent) -> None:
        self._send(TurnReport(rank=self.rank, task_id=event.task_id, tokens=event.output_tokens,
                              context_tokens=event.context_tokens, done=event.done,
                              version=event.version, running=event.running))

    async def _leave_rollout(self) -> None:
        """Detach every task at its next turn boundary (they go on elsewhere), drop the engine."""
        assert self.agent is not None and self.engine is not None
        for task_id in list(self.tasks):
            self.agent.detach(task_id)
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        last = await self.engine.stop()
        self.queries_before += last.prefix_queries
        self.hits_before += last.prefix_hits
        self.engine = self.agent = None
        self.pending_weights = None

    async def _apply_pending_weights(self) -> None:
        """New weights wait while an evaluation task runs here (its version is anchored). One
        update at a time, the newest last: a boundary's and an evaluation's end may both ask;
        a failed update stays pending (unless a newer one came) and is raised."""
        async with self._updating:
            while self.pending_weights is not None and not self.eval_tasks \
                    and self.engine is not None:
                state, version = pending = self.pending_weights
                self.pending_weights = None
                try:
                    await self.engine.update(state, version)
                except Exception:
                    if self.pending_weights is None:
                        self.pending_weights = pending
                    raise

    # -- trainer ---------------------------------------------------------------------------------

    def _to_stream(self, msg: MicroBatchData | StepClosed | AbortStep) -> None:
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

    async def _run_commands(self) -> None:
        while True:
            cmd = await self.commands.get()
            try:
                if isinstance(cmd, TrainStep):
                    await self._train(cmd)
                elif isinstance(cmd, AdmitTask):
                    self._admit(cmd)
                elif isinstance(cmd, Shutdown):
                    log.info("rank %d: shutdown (%s)", self.rank, cmd.reason)
                    assert self._stopping is not None
                    self._stopping.set()
                    return
                else:
                    await self._boundary(cmd)
            except Exception as exc:
                log.exception("rank %d: %s failed", self.rank, type(cmd).__name__)
                self._send(Ack(rank=self.rank, ref=cmd.seq, ok=False, error=f"{exc}"[:500]))
                if not isinstance(cmd, SyncWeights):
                    raise
                # a broadcast a member died in: the coordinator sends it again without that
                # rank (another group); this rank's role is unchanged until one succeeds

    # -- the boundary ----------------------------------------------------------------------------

    async def _boundary(self, cmd: SyncWeights) -> None:
        roles = [Role(r) for r in cmd.roles]
        new = roles[self.rank]
        new_actors = _ranks_with(roles, Role.ACTOR, self.is_sync)
        if self.is_sync:  # every rank trained the same update: its engine takes its own weights
            if cmd.version > 0:
                assert self.actor is not None and self.engine is not None
                state = await asyncio.to_thread(self.actor.backend.full_state_dict)
                await self._export(cmd, state)
                self.pending_weights = (state, cmd.version)
                await self._apply_pending_weights()
            self.version = cmd.version
            if new_actors != self.actor_set:  # a rank died: the others train on without it
                self.actor_set = new_actors
                await asyncio.to_thread(self._rewrap_actor)
            self._ack(cmd)
            return
        if self.role is Role.ROLLOUT and new is not Role.ROLLOUT and self.engine is not None:
            await self._leave_rollout()  # (not again when a failed boundary is sent again)
        if cmd.checkpoint and self.role is Role.ACTOR:
            await asyncio.to_thread(self._save_checkpoint, cmd)
        # a backend that cannot wrap its module for another group (FSDP2) builds every actor of
        # a new actor set afresh: each gets the weights and the optimizer state, as a joiner does
        rebuilt = () if self._rewraps or new_actors == self.actor_set else new_actors
        receivers = set(cmd.joiners) | set(rebuilt)
        state = None
        if cmd.version > 0:
            state = await asyncio.to_thread(self._sync_weights, cmd, bool(receivers),
                                            self.rank in receivers)
            await self._export(cmd, state)
        self.version = cmd.version
        await self._take_role(new, new_actors, state, cmd, rebuild=self.rank in rebuilt)
        self._ack(cmd)

    async def _take_role(self, new: Role, new_actors: tuple[int, ...],
                         state: dict[str, torch.Tensor] | None, cmd: SyncWeights, *,
                         rebuild: bool = False) -> None:
        changed = new_actors != self.actor_set
        self.actor_set = new_actors
        if new is Role.ROLLOUT:
            if self.engine is None:
                await self._start_engine(self.version, state)
            elif state is not None:
                self.pending_weights = (state, self.version)
                await self._apply_pending_weights()
        # building a model and wrapping it (a collective: DDP syncs it over the group) run in
        # a worker thread, so heartbeats go on however long they take on a loaded machine
        if new is Role.ACTOR:
            if self.actor is None or rebuild:
                self.actor = None  # the old shards go before the new model is built
                await asyncio.to_thread(self._make_actor, None, state)
                if self._joined_optimizer is not None:
                    self.actor.load_optimizer_state(self._joined_optimizer)
            elif changed:
                await asyncio.to_thread(self._rewrap_actor)
        else:
            self.actor = None
        self._joined_optimizer = None
        if self._needs_ref(new):
            await asyncio.to_thread(self._make_ref)
        else:
            self.ref = None
        if new is not self.role:
            log.info("rank %d: %s -> %s at version %d", self.rank, self.role.value, new.value,
                     self.version)
        self.role = new

    def _ack(self, cmd) -> None:
        self._send(Ack(rank=self.rank, ref=cmd.seq, ok=True))


# -- helpers -------------------------------------------------------------------------------------

def _ranks_with(roles: list[Role], role: Role, is_sync: bool) -> tuple[int, ...]:
    """The ranks of ``role``; under ``is_sync`` every live rank (an idle one died)."""
    if is_sync:
        return tuple(r for r, x in enumerate(roles) if x is not Role.IDLE)
    return tuple(r for r, x in enumerate(roles) if x is role)
