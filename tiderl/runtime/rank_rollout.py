"""A rank's rollout side: its engine, the agent loops of the tasks admitted to it, and the new
weights an evaluation task holds back.

    AdmitTask ──> an agent loop per task on the engine ──TurnReport, TaskFinished──> bus
    PauseTask / ResumeTask / DetachTask ──> that task's loop, at its next turn boundary
    a boundary: leave (every task detached, TaskDetached with its carry; the engine dropped, or
        its server put to sleep) | join (the engine built, or the server woken, with the
        version's weights) | new weights (applied once no evaluation task runs here: its
        version is anchored, paper §3.2)

The engine is in-process (:class:`EmbeddedEngine`) or this rank's own server
(:class:`ServerEngine`: awake while the rank rolls out, asleep otherwise); the agent loops talk
to its client either way. Its prefix-cache counters count from its last start, so the side adds
up what each stint reported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from tiderl.core.types import Trajectory
from tiderl.engine.clients import server_client
from tiderl.engine.request import SamplingParams
from tiderl.env.client import HTTPEnvClient
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
    Ack,
    AdmitTask,
    Message,
    RankMetrics,
    TaskDetached,
    TaskFinished,
    TurnReport,
)
from tiderl.runtime.rank_engines import EmbeddedEngine, EngineStats, RankEngine, ServerEngine
from tiderl.runtime.rank_wire import carry_data, carry_of
from tiderl.runtime.rank_world import RankWorld
from tiderl.runtime.rollout_log import RolloutLog
from tiderl.runtime.trajectory_wire import turn_data

log = logging.getLogger("tiderl.rank")

EXIT_ENGINE_LOST = 4
AGENT_WAIT_SLACK_S = 30.0  # an agent's call outlasts its deadline by this: the service ends it
ENGINE_STALL_FACTOR = 2  # a server silent this many heartbeat windows has stalled (SIGSTOP)


class RolloutSide:
    def __init__(self, world: RankWorld, profile: Profile, send: Callable[[Message], None],
                 env: HTTPEnvClient | None) -> None:
        self.world, self.profile, self.send, self.env = world, profile, send, env
        self.rank = world.rank
        self.engine: RankEngine | None = None  # while rolling out
        self.server: ServerEngine | None = None  # this rank's engine server, awake or asleep
        self.answered_at = 0.0  # when the engine last answered a heartbeat's stats
        self.agent: AgentLoop | None = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.eval_tasks: set[str] = set()
        self.pending_weights: tuple[dict[str, torch.Tensor], int] | None = None
        self.updating = asyncio.Lock()  # engine weight updates, one at a time
        self.counted = EngineStats()  # prefix counters of the engines dropped earlier
        self.log = RolloutLog(world.args.run_dir, self.rank)  # logging.rollouts

    @property
    def is_rolling_out(self) -> bool:
        return self.engine is not None

    # -- the engine ------------------------------------------------------------------------------

    def open_server(self) -> None:
        """A server backend: this rank's server, reached at its URL (it loads the model itself;
        the rank only needs the model's shapes)."""
        assert self.world.kit is not None
        engine = self.profile.engine
        client = server_client(engine.backend, self.world.args.engine_url,
                               flush_on_update=engine.kv_on_update == "flush")
        self.server = ServerEngine(client, engine, self.world.args.run_dir / "weights",
                                   self.world.kit.config, self.world.kit.tokenizer,
                                   self.profile.model.path)

    async def wait_server(self, serving: bool) -> None:
        """Before the rank's Hello: its server serves version 0, or sleeps meanwhile."""
        assert self.server is not None
        await self.server.wait_up(serving)
        if serving:
            self.attach(self.server)

    def attach(self, engine: RankEngine) -> None:
        self.engine = engine
        self.answered_at = time.monotonic()  # up: it answered its health check
        engine_cfg, env_cfg, kit = self.profile.engine, self.profile.env, self.world.kit
        assert kit is not None
        sampling = SamplingParams(max_tokens=engine_cfg.max_new_tokens,
                                  temperature=engine_cfg.temperature, top_p=engine_cfg.top_p)
        self.agent = AgentLoop(engine.client, self.env, kit.encoder, sampling,
                               record=self.profile.logging.rollouts,
                               max_turns=env_cfg.max_turns,
                               max_context_tokens=min(engine_cfg.kv_cache_tokens,
                                                      kit.config.max_position_embeddings),
                               version=lambda: engine.version, on_turn=self._on_turn,
                               placer=kit.placer, image_window=env_cfg.image_window,
                               agents=env_cfg.agents,
                               agent_wait_s=env_cfg.agent_timeout_s + AGENT_WAIT_SLACK_S,
                               block_size=engine_cfg.block_size)

    async def join(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        """Join rollout serving ``version`` (``state``: its weights, None for the initial
        ones): build the in-process engine, or wake this rank's server with them."""
        if self.server is not None:
            weights: dict[str, torch.Tensor] | Path | None = state
            if weights is None:  # the initial weights: the model folder, or the seeded model's
                path = self.profile.model.path
                weights = Path(path) if path \
                    else self.world.model(torch.device("cpu")).state_dict()
            await self.server.start(version, weights)
            self.attach(self.server)
            return
        model = await asyncio.to_thread(self.world.model)
        self.attach(EmbeddedEngine(model, self.profile.engine, version, state,
                                   self.profile.model.path or None))

    async def leave(self) -> None:
        """Detach every task at its next turn boundary (they go on elsewhere), drop the engine."""
        assert self.agent is not None and self.engine is not None
        for task_id in list(self.tasks):
            self.agent.detach(task_id)
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        last = await self.engine.stop()
        self.counted = EngineStats(prefix_queries=self.counted.prefix_queries
                                   + last.prefix_queries,
                                   prefix_hits=self.counted.prefix_hits + last.prefix_hits)
        self.engine = self.agent = None
        self.pending_weights = None

    async def take_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """New weights for the engine, applied now or once the evaluation tasks here end."""
        self.pending_weights = (state, version)
        await self.apply_pending_weights()

    async def apply_pending_weights(self) -> None:
        """One update at a time, the newest last: a boundary's and an evaluation's end may both
        ask; a failed update stays pending (unless a newer one came) and is raised."""
        async with self.updating:
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

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.engine is not None:
            await self.engine.close()
        if self.server is not None and self.server is not self.engine:
            await self.server.close()
        if self.env is not None:
            await self.env.close()

    # -- heartbeats ------------------------------------------------------------------------------

    async def metrics(self, role: str) -> RankMetrics:
        """This rank's engine figures for a heartbeat (bounded: a slow server must not hold
        back the next heartbeat; one silent too long is treated as gone)."""
        stats, engine, rt = EngineStats(), self.engine, self.profile.runtime
        if engine is not None:
            try:
                stats = await asyncio.wait_for(engine.stats(), rt.heartbeat_s)
                self.answered_at = time.monotonic()
            except Exception as exc:  # a server that does not answer: this beat has no stats
                log.warning("rank %d: engine stats: %s", self.rank, exc or type(exc).__name__)
                if isinstance(exc, asyncio.TimeoutError | httpx.TransportError):
                    self._check_stalled(engine)
            if self.engine is not engine:  # it left rollout meanwhile: its stint is counted
                stats = EngineStats()
        queries, hits = stats.prefix_queries, stats.prefix_hits
        return RankMetrics(rank=self.rank, role=role, kv_tokens_used=stats.used_tokens,
                           kv_tokens_capacity=stats.capacity_tokens,
                           prefix_hit_rate=hits / queries if queries else 0.0,
                           running=stats.running, waiting=stats.waiting,
                           prefix_queries=self.counted.prefix_queries + queries,
                           prefix_hits=self.counted.prefix_hits + hits,
                           prefill_tokens_per_s=stats.prefill_tokens_per_s)

    def _check_stalled(self, engine: RankEngine) -> None:
        """An engine server that has answered no heartbeat's stats for ``ENGINE_STALL_FACTOR``
        heartbeat windows (stopped, or wedged) is treated as gone: the rank exits, and its tasks
        go back to CTB, rather than wait out each request's timeout (minutes)."""
        rt = self.profile.runtime
        silent = time.monotonic() - self.answered_at
        if engine is not self.server or \
                silent < ENGINE_STALL_FACTOR * rt.heartbeat_s * rt.heartbeat_misses:
            return
        _exit(f"rank {self.rank}: its engine server has not answered for {silent:.0f} s; "
              "exiting, so that its tasks go back to CTB", EXIT_ENGINE_LOST)

    # -- tasks -----------------------------------------------------------------------------------

    def admit(self, msg: AdmitTask) -> None:
        if self.agent is None:
            self.send(Ack(rank=self.rank, ref=msg.seq, ok=False,
                          error=f"rank {self.rank} is not a rollout rank"))
            return
        task = AgentTask(msg.task_id, msg.group_id, msg.env, msg.task or None, msg.seed, msg.eval)
        carry = None if msg.carry is None else carry_of(msg.carry)
        if msg.eval:
            self.eval_tasks.add(msg.task_id)
        self.agent.pin = msg.pin and self.agent.engine.supports_pins
        self.tasks[msg.task_id] = asyncio.create_task(self._play(task, carry))

    def steer(self, task_id: str, action: str) -> None:
        """``pause``, ``resume`` or ``detach`` a task here, at its next turn boundary."""
        if self.agent is not None and task_id in self.tasks:
            getattr(self.agent, action)(task_id)

    async def _play(self, task: AgentTask, carry: TaskCarry | None) -> None:
        assert self.agent is not None
        try:
            trajectory = await self.agent.run(task, carry)
        except TaskDetachedError as exc:
            self.send(TaskDetached(rank=self.rank, task_id=task.task_id,
                                   carry=carry_data(exc.carry)))
        except asyncio.CancelledError:
            raise
        except EngineUnreachableError as exc:  # the rank cannot roll out: it goes, its tasks
            _exit(f"rank {self.rank}: {exc}; exiting, so that its tasks go back to CTB",
                  EXIT_ENGINE_LOST)
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
                await self.apply_pending_weights()
            except Exception:
                log.exception("rank %d: loading held-back weights failed", self.rank)

    def _finish(self, task: AgentTask, trajectory: Trajectory, error: str = "") -> None:
        self.send(TaskFinished(rank=self.rank, task_id=task.task_id, group_id=task.group_id,
                               error=error, reward=float(trajectory.reward or 0.0),
                               turns=[turn_data(t) for t in trajectory.turns],
                               num_tokens=trajectory.num_tokens,
                               image_data=trajectory.image_data))
        transcript = self.agent.take_transcript(task.task_id) if self.agent else []
        if self.profile.logging.rollouts:
            self.log.write(task, trajectory, transcript)

    def _on_turn(self, event: TurnEvent) -> None:
        self.send(TurnReport(rank=self.rank, task_id=event.task_id, tokens=event.output_tokens,
                             context_tokens=event.context_tokens, done=event.done,
                             version=event.version, running=event.running,
                             reused_tokens=event.reused_tokens,
                             reusable_tokens=event.reusable_tokens))


def _exit(message: str, code: int) -> None:
    """Leave the process now: a worker thread may be blocked in a collective."""
    log.error("%s", message)
    logging.shutdown()
    os._exit(code)
