"""The environment service without HTTP: environments, the session table, latency models.

    /start ──> EnvService.start ──make_env, reset──> SessionTable.create (evicts on a full table)
    /observation ──> EnvService.step ──sleep(step latency)──> env.step ──> ObservationResponse
    /end /pause /resume ──> SessionTable

An agent (``env.agents``, :mod:`tiderl.env.agents`) is a session whose environment is its
:class:`AgentRun`: /start launches the agent and answers with its first model request;
/observation hands the model's answer (the request's ``completion``) to the agent (after the step
latency model's delay, as a native step: simulated tool time) and answers with its next request,
or ``done`` and its reward once it ends. Its endpoint routes
(:mod:`tiderl.env.agent_api`) find the run by task id or key (:attr:`EnvService.agents`). A session
that goes, however (ended, expired, evicted, its rank dead), stops its agent. An agent that fails
is answered 422 ``agent_failed`` with the reason, the session then done.

Every answer carries both forms of an observation (:func:`tiderl.env.base.observation_messages`
and ``observation_text``), whichever form the environment returned, and ``/start`` the
environment's tool schemas. An observation whose image breaks the limits of
:mod:`tiderl.env.images` (the environment raised :class:`ImageError` building it) is answered
422 ``invalid_observation``, the session left as the environment left it.

A session is "in a step" from the start of its /observation (latency included) to its answer;
the table never evicts it meanwhile, and /start is refused (429) only when every session is.

The HTTP server (:mod:`tiderl.env.server`) and :class:`tiderl.env.client.InProcessEnvClient`
both call it, so the two see the same semantics and the same errors (:func:`error_status`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tiderl.core.quote import short
from tiderl.env.agents import (
    AgentFailed,
    AgentRun,
    AgentTask,
    TaskClosed,
    Turn,
    launcher,
    new_key,
)
from tiderl.env.base import (
    Environment,
    UnknownEnvironment,
    observation_messages,
    observation_text,
)
from tiderl.env.config import EnvConfig
from tiderl.env.images import ImageError
from tiderl.env.latency import LatencyModel
from tiderl.env.protocol import (
    ObservationRequest,
    ObservationResponse,
    OwnerRequest,
    OwnerResponse,
    ProtocolError,
    SessionRequest,
    SessionResponse,
    StartRequest,
    StartResponse,
    messages_text,
)
from tiderl.env.registry import make_env
from tiderl.env.sessions import SessionLimit, SessionState, SessionTable, UnknownSession

ENDED_AGENTS_KEPT = 8192  # ended tasks a late request is told about (409), not 404


class SessionConflict(Exception):
    """A step on a paused session or a finished episode (answered 409)."""


class EnvService:
    def __init__(self, config: EnvConfig, *, clock: Callable[[], float] = time.monotonic,
                 gym: str | None = None, seed: int = 0):
        self.config = config
        self.clock = clock
        self.gym = gym
        self.table: SessionTable[Environment | AgentRun] = SessionTable(
            config.max_sessions, config.idle_ttl_s, on_drop=self._dropped)
        self.agents: dict[str, AgentRun] = {}  # by task id, while its session is open
        self.agent_keys: dict[str, AgentRun] = {}  # by key
        self.agent_sessions: dict[str, AgentRun] = {}  # by the session ids they named
        self.agent_url = ""  # where agents reach this service (set by the server)
        self.model_path = ""  # the job's model folder, told to agents (set by the server)
        self.app: Any = None  # its ASGI app, which entry agents call in-process
        self.ended_agents: OrderedDict[str, None] = OrderedDict()  # task ids and keys, recent
        self.num_agent_tasks = 0
        self.start_latency = LatencyModel(config.start_latency, random.Random(seed))
        self.step_latency = LatencyModel(config.step_latency, random.Random(seed + 1))
        self.num_steps = 0

    def _dropped(self, env: Environment | AgentRun) -> None:
        if isinstance(env, AgentRun):
            env.close()
            if self.agents.get(env.task.task_id) is env:
                del self.agents[env.task.task_id]
            self.agent_keys.pop(env.task.api_key, None)
            for name in (env.task.task_id, env.task.api_key):
                self.ended_agents[name] = None
            while len(self.ended_agents) > ENDED_AGENTS_KEPT:
                self.ended_agents.popitem(last=False)

    @property
    def env_names(self) -> list[str]:
        return [*self.config.envs, *(["gym", f"gym:{self.gym}"] if self.gym else [])]

    def resolve(self, name: str) -> str:
        """The registry name for a requested env; unknown names are a 400."""
        if name not in self.env_names:
            raise ProtocolError(f"env: unknown environment {short(name)}; this server has "
                                f"{', '.join(self.env_names)}", "unknown_env", 400)
        return f"gym:{self.gym}" if name == "gym" else name

    async def start(self, req: StartRequest) -> StartResponse:
        if req.env in self.config.agents:
            return await self._start_agent(req)
        registry_name = self.resolve(req.env)
        self.table.check_room(self.clock())  # refuse before doing any work
        await _sleep(self.start_latency.sample())
        try:
            env = make_env(registry_name, max_turns=self.config.max_turns,
                           options=self.config.options.get(req.env))
            observation, info = env.reset(req.task, req.seed)
        except UnknownEnvironment as exc:
            raise ProtocolError(str(exc), "unknown_env", 400) from exc
        except ImageError as exc:
            raise _bad_observation(req.env, exc) from exc
        except ValueError as exc:  # e.g. a task the environment cannot parse
            raise ProtocolError(f"{req.env}: {exc}", "invalid_task", 400) from exc
        messages = observation_messages(observation)
        session = self.table.create(req.env, env, self.clock(), owner=req.owner)
        return StartResponse(session.id, observation_text(observation), info, messages,
                             list(env.tools))

    async def _start_agent(self, req: StartRequest) -> StartResponse:
        if not self.agent_url:
            raise ProtocolError(f"env: {short(req.env)} is an agent, served only by the "
                                "environment service over HTTP", "unknown_env", 400)
        self.table.check_room(self.clock())
        self.num_agent_tasks += 1
        task_id = req.task_id or f"agent-{self.num_agent_tasks}"
        if task_id in self.agents:  # a start sent again: the earlier one is dropped
            self._end_agent(self.agents[task_id])
        key = new_key()
        base = f"{self.agent_url}/tasks/{task_id}"
        task = AgentTask(task_id, req.group_id, req.env, req.task, req.seed, f"{base}/v1", key,
                         base, self.model_path, dict(self.config.options.get(req.env, {})))
        config = self.config.agents[req.env]
        run = AgentRun(config, task, deadline_s=self.config.agent_timeout_s, local_app=self.app,
                       sessions=self.agent_sessions)
        session = self.table.create(req.env, run, self.clock(), owner=req.owner)
        self.agents[task_id], self.agent_keys[key] = run, run
        in_step = self.table.begin_step(session.id, self.clock())
        try:
            turn = await run.start(launcher(config))
        except AgentFailed as exc:
            self._end_agent(run)
            raise ProtocolError(f"{req.env}: {exc}", "agent_failed", 422) from None
        finally:
            self.table.end_step(in_step, self.clock())
        return StartResponse(session.id, messages_text(turn.messages), {"task_id": task_id},
                             turn.messages, turn.tools, agent=True, prompt_ids=turn.prompt_ids,
                             sampling=turn.sampling)

    def _end_agent(self, run: AgentRun) -> None:
        for session in list(self.table.sessions.values()):
            if session.env is run:
                self.table.end(session.id, self.clock())
        run.close()

    async def _step_agent(self, req: ObservationRequest, session) -> ObservationResponse:
        run: AgentRun = session.env
        if req.completion is None:
            raise ProtocolError("completion: an agent session's /observation carries the "
                                "model's completion")
        in_step = self.table.begin_step(req.session, self.clock())
        try:
            await _sleep(self.step_latency.sample())  # simulated tool time, as for native steps
            out = await run.step(req.action, req.completion)
        except (AgentFailed, TaskClosed) as exc:
            session.is_done = True
            run.close()
            raise ProtocolError(f"{session.env_name}: {exc}", "agent_failed", 422) from None
        finally:
            self.table.end_step(in_step, self.clock())
        session.num_steps += 1
        self.num_steps += 1
        if not isinstance(out, Turn):
            session.is_done = True
            return ObservationResponse("", out, True, {"agent_segments":
                                                       run.conversation.num_segments})
        return ObservationResponse(messages_text(out.messages), 0.0, False, {}, out.messages,
                                   restart=out.restart, tools=out.tools,
                                   prompt_ids=out.prompt_ids, sampling=out.sampling)

    async def step(self, req: ObservationRequest) -> ObservationResponse:
        session = self._steppable(req.session)
        if isinstance(session.env, AgentRun):
            return await self._step_agent(req, session)
        in_step = self.table.begin_step(req.session, self.clock())
        try:
            await _sleep(self.step_latency.sample())
            session = self._steppable(req.session)  # it may have ended during the sleep
            self.table.touch(req.session, self.clock())
            try:
                result = session.env.step(req.action)
            except ImageError as exc:
                raise _bad_observation(session.env_name, exc) from exc
            except ValueError as exc:
                raise ProtocolError(f"action: {exc}", "invalid_action", 400) from exc
        finally:
            self.table.end_step(in_step, self.clock())
        session.num_steps += 1
        session.is_done = result.done
        self.num_steps += 1
        return ObservationResponse(observation_text(result.observation), float(result.reward),
                                   result.done, result.info,
                                   observation_messages(result.observation))

    def end_owner(self, req: OwnerRequest) -> OwnerResponse:
        return OwnerResponse(req.owner, self.table.end_owner(req.owner))

    def end(self, req: SessionRequest) -> SessionResponse:
        self.table.end(req.session, self.clock())
        return SessionResponse(req.session, "ended")

    def pause(self, req: SessionRequest) -> SessionResponse:
        self.table.pause(req.session, self.clock())
        return SessionResponse(req.session, "paused")

    def resume(self, req: SessionRequest) -> SessionResponse:
        self.table.resume(req.session, self.clock())
        return SessionResponse(req.session, "active")

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "envs": self.env_names, "sessions": self.table.num_open,
                "max_sessions": self.table.max_sessions}

    def _steppable(self, session_id: str):
        session = self.table.get(session_id, self.clock())
        if session.state is SessionState.PAUSED:
            raise SessionConflict(f"session {short(session_id)} is paused; /resume it first")
        if session.is_done:
            raise SessionConflict(f"session {short(session_id)}: the episode is done; /end it")
        return session


def _bad_observation(env: str, exc: ImageError) -> ProtocolError:
    return ProtocolError(f"{env}: observation: {exc}", "invalid_observation", 422)


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


def error_status(exc: Exception) -> tuple[int, str, dict[str, str]]:
    """HTTP status, error type and extra headers for an exception the service raises."""
    if isinstance(exc, ProtocolError):
        return exc.status, exc.kind, {}
    if isinstance(exc, UnknownSession):
        return 404, "unknown_session", {}
    if isinstance(exc, SessionLimit):
        return 429, "session_limit", {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    if isinstance(exc, SessionConflict):
        return 409, "session_conflict", {}
    return 500, "internal_error", {}
