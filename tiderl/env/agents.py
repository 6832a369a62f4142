"""Agents as environments: a program that calls the model through an API, run once per task.

An agent is written against the OpenAI or Anthropic API (its own loop, an SDK's agent runner, a
harness in any language). The environment service runs it for a task and serves it a model
endpoint of its own (:mod:`tiderl.env.agent_api`); each request the agent sends is one turn of the
task, and the rollout rank that plays the task answers it. To the rank an agent task is an
environment session like any other:

    rank  /start ───────> launch the agent ──> its first model request ──> StartResponse
                            (the request's messages and tools, as an environment's opening)
    rank  /observation ─> the model's answer to the request ──> the agent (its tools run)
          (completion)    ──> its next request ──> ObservationResponse (the new messages)
                          or the agent ends ──> ObservationResponse(done, reward)

So everything the rank does for a native task holds for an agent task: CTB admits it (the agent
starts), knows when it waits on its tools (between an answer and its next request), pauses it (the
next request waits, held open, until the task resumes), and ERS moves it to another rank (the
endpoint stays here; the agent never notices).

Token fidelity (:class:`Conversation`): when a request repeats the previous request and the answer
it got, and adds messages, only the added messages are new (the rank encodes them after the
output ids it sampled, which stay exact). Any other request (a trimmed, summarised, edited or
branched history, other tools) starts a new training segment from the request as rendered
(``restart``); it is never re-encoded silently. Token-in requests (``/inference/v1/generate``)
extend when their ids start with the previous prompt and output ids.

Two kinds of agent (a profile's ``env.agents``, :class:`AgentConfig`):

* ``entry: package.module:function``: ``async def function(task, client)`` in the environment
  service's process, given the :class:`AgentTask` and an ``openai.AsyncOpenAI`` on the task's
  endpoint; it returns the reward, or None to leave it to ``POST /tasks/{id}/reward``.
* ``command: "python my_agent.py --flag"``: a process per task, in any language, with
  ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` set for
  the task and the task as JSON in ``TIDERL_TASK``; its reward is the last stdout line, JSON
  ``{"reward": r}``, or the reward route. Its stderr goes to the service's log.

An agent that raises, exits non-zero, passes its deadline (``env.agent_timeout_s``), floods
requests (more than ``MAX_QUEUED_REQUESTS`` waiting) or ends without calling the model fails its
task (:class:`AgentFailed`, the reason in the rank's error, so in ``events.jsonl``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import importlib
import inspect
import json
import logging
import os
import secrets
import shlex
import signal
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tiderl.core.quote import short
from tiderl.env.config import AgentConfig
from tiderl.env.protocol import Completion, Message
from tiderl.env.tools import answer_message

log = logging.getLogger("tiderl.agents")

MAX_SESSIONS = 16  # session ids one task may name (name_session)
MIN_SESSION_CHARS = 16  # a session id stands for the task's key: it must not be guessable
MAX_QUEUED_REQUESTS = 16  # model requests of one task waiting for their turn; more: 429
RECENT_ANSWERS = 8  # answers kept per task for SDK retries of the same request
STOP_GRACE_S = 2.0  # a command agent that ends (or is ended) gets this long before SIGKILL
NO_REWARD = 0.0  # an agent that ends without giving a reward


@dataclass(frozen=True)
class AgentTask:
    """What an agent is told about its task (``TIDERL_TASK`` for a command agent)."""

    task_id: str
    group_id: str
    env: str  # the agent's name in env.agents
    prompt: str | None  # the task text (env.tasks), None without one
    seed: int
    base_url: str  # the task's OpenAI base URL: .../tasks/{task_id}/v1
    api_key: str  # the task's key (Authorization: Bearer, or x-api-key)
    anthropic_base_url: str  # the same endpoint, as the Anthropic SDK wants it (no /v1)
    model: str = ""  # the job's model folder (a client that renders its own tokens loads its
    # tokenizer and chat template from it); "" for a seeded model
    options: dict = field(default_factory=dict)  # the agent's env.options (its arguments)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class AgentFailed(Exception):
    """The agent raised, exited non-zero, passed its deadline, flooded or never called the
    model: its task fails with this reason."""


class TaskClosed(Exception):
    """A request for a task that has finished, failed or been dropped (answered 409)."""


class TooManyRequests(Exception):
    """More of a task's requests wait than ``MAX_QUEUED_REQUESTS`` (answered 429)."""


class RequestRefused(Exception):
    """The rank could not serve the request as asked (a prompt over the context length):
    answered 400 with this message; the task goes on."""


# ------------------------------------------------------------------------------ conversation


@dataclass
class ModelRequest:
    """One request of an agent, waiting for its answer: the conversation as messages (the
    chat and messages routes) or as token ids (the token-in route)."""

    messages: list[Message] | None
    tools: list[dict[str, Any]]
    prompt_ids: list[int] | None
    sampling: dict[str, Any]  # max_tokens, stop, seed: what the rank honours per turn
    digest: str  # of the body, for SDK retries
    answer: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                   .create_future())


@dataclass(frozen=True)
class Turn:
    """What the rank is told about a request: the messages (or ids) new since its last answer,
    or, ``restart``, the whole request (a new training segment)."""

    messages: list[Message]
    tools: list[dict[str, Any]]
    prompt_ids: list[int] | None
    restart: bool
    sampling: dict[str, Any]


def message_key(message: Message) -> tuple:
    """What of a message its rendering depends on (tool-call ids and JSON spacing aside)."""
    calls = tuple((call.function.name, _canonical(call.function.arguments))
                  for call in message.tool_calls or ())
    return (message.role, message.text(), calls, message.name)


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except (ValueError, RecursionError):
        return arguments


@dataclass
class Conversation:
    """The task's conversation as the rank last saw it: each request becomes a :class:`Turn`
    (what is new, or a restart)."""

    messages: list[tuple] | None = None  # message_key of the last request and its answer
    tools: list[dict[str, Any]] | None = None
    ids: list[int] | None = None  # the last token-in prompt and its output ids
    num_segments: int = 0

    def turn(self, request: ModelRequest) -> Turn:
        if request.prompt_ids is not None:
            ids, new = request.prompt_ids, None
            if self.ids is not None and len(ids) > len(self.ids) \
                    and ids[:len(self.ids)] == self.ids:
                new = ids[len(self.ids):]
            self.messages = self.tools = None
            return self._counted(Turn([], [], new if new is not None else list(ids),
                                      new is None, request.sampling))
        assert request.messages is not None
        keys = [message_key(m) for m in request.messages]
        known = self.messages
        extends = (known is not None and self.tools == request.tools
                   and len(keys) > len(known) and keys[:len(known)] == known)
        self.ids = None
        new = request.messages[len(known):] if extends else list(request.messages)
        return self._counted(Turn(new, request.tools, None, not extends, request.sampling))

    def _counted(self, turn: Turn) -> Turn:
        if turn.restart:
            self.num_segments += 1
        return turn

    def answered(self, request: ModelRequest, completion: Completion, answer: Message) -> None:
        """The rank answered ``request``: the next request extends it and ``answer``."""
        if request.prompt_ids is not None:
            self.ids = [*request.prompt_ids, *completion.token_ids]
        else:
            assert request.messages is not None
            self.messages = [*map(message_key, request.messages), message_key(answer)]
            self.tools = request.tools


def body_digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


# ------------------------------------------------------------------------------ one run


@dataclass(frozen=True)
class Answer:
    """The rank's answer to a request: the model's text, its ids and logprobs, and the text as
    an assistant message (content and tool calls) for the chat routes."""

    text: str
    completion: Completion
    message: Message


class AgentRun:
    """One task's agent: its process or coroutine, its queue of model requests, the request
    the rank is answering, its conversation and its reward."""

    def __init__(self, config: AgentConfig, task: AgentTask, *, deadline_s: float,
                 local_app: Any = None, sessions: dict[str, AgentRun] | None = None) -> None:
        """``local_app``: the service's ASGI app, which an entry agent's client calls
        in-process; ``sessions``: the service's runs by the session ids they named."""
        self.config, self.task = config, task
        self.sessions = sessions if sessions is not None else {}
        self.session_ids: list[str] = []
        self.deadline_s = deadline_s
        self.local_app = local_app
        self.num_answers = 0
        self.requests: asyncio.Queue[ModelRequest] = asyncio.Queue()
        self.current: ModelRequest | None = None  # sent to the rank, not answered yet
        self.recent: OrderedDict[str, ModelRequest] = OrderedDict()  # by digest
        self.conversation = Conversation()
        self.reward: float | None = None  # POST /tasks/{id}/reward
        self.closed = False
        self.ended: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self._runner: asyncio.Task | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._deadline: asyncio.TimerHandle | None = None

    # -- the agent's side (the routes) ----------------------------------------------------

    async def ask(self, request: ModelRequest, retry: bool) -> Answer:
        """A model request from the agent: queued until the rank answers it. ``retry`` (the
        SDK's retry header): the same body as an earlier request is that request, answered
        once."""
        if retry and (earlier := self.recent.get(request.digest)) is not None:
            return await asyncio.shield(earlier.answer)
        if self.closed:
            raise TaskClosed(f"task {short(self.task.task_id)} has ended")
        if self.requests.qsize() >= MAX_QUEUED_REQUESTS:
            raise TooManyRequests(f"task {short(self.task.task_id)}: more than "
                                  f"{MAX_QUEUED_REQUESTS} requests wait for the model")
        self.recent[request.digest] = request
        while len(self.recent) > RECENT_ANSWERS:
            self.recent.popitem(last=False)
        self.requests.put_nowait(request)
        return await asyncio.shield(request.answer)

    def name_session(self, session_id: str) -> None:
        """Requests at the root whose ``X-Session-ID`` is ``session_id`` are this task's, with
        or without its key."""
        if self.closed:
            raise TaskClosed(f"task {short(self.task.task_id)} has ended")
        if not isinstance(session_id, str) or len(session_id) < MIN_SESSION_CHARS:
            raise ValueError(f"a session id stands for the task's key: expected a string of "
                             f"{MIN_SESSION_CHARS} characters or more")
        if self.sessions.get(session_id, self) is not self:
            raise ValueError(f"session id {short(session_id)} is another task's")
        if session_id not in self.session_ids:
            if len(self.session_ids) >= MAX_SESSIONS:
                raise ValueError(f"task {short(self.task.task_id)} has named {MAX_SESSIONS} "
                                 "session ids already")
            self.session_ids.append(session_id)
            self.sessions[session_id] = self

    def set_reward(self, reward: float) -> None:
        if self.closed:
            raise TaskClosed(f"task {short(self.task.task_id)} has ended")
        self.reward = reward

    def finish(self) -> None:
        """The agent says it is done (``POST /tasks/{id}/finish``): the task ends with its
        reward, its process or coroutine stopped."""
        if self.closed:
            raise TaskClosed(f"task {short(self.task.task_id)} has ended")
        self._end(self.reward)

    # -- the rank's side (the session) ---------------------------------------------------

    async def start(self, launch: Callable[[AgentRun], Awaitable[float | None]]) -> Turn:
        """Launch the agent; its first request (:class:`AgentFailed` if it ends first)."""
        self._deadline = asyncio.get_running_loop().call_later(self.deadline_s, self._expire)
        self._runner = asyncio.create_task(self._run(launch))
        out = await self._next()
        if out is None:
            raise AgentFailed("the agent ended without calling the model")
        return out

    async def step(self, text: str, completion: Completion) -> Turn | float:
        """Answer the request in hand with the model's ``text`` and ``completion``; the agent's
        next request, or its reward once it ends."""
        request = self.current
        if request is None:
            raise TaskClosed(f"task {short(self.task.task_id)}: no request waits for an answer")
        self.current = None
        if completion.error:
            request.answer.set_exception(RequestRefused(completion.error))
        else:
            message = answer_message(text, f"call_{self.num_answers}_")
            self.num_answers += 1
            self.conversation.answered(request, completion, message)
            request.answer.set_result(Answer(text, completion, message))
        out = await self._next()
        return self._reward() if out is None else out

    def _reward(self) -> float:
        """The reward the agent returned, else the reward route's, else ``NO_REWARD``."""
        given = self.ended.result()
        if isinstance(given, (int, float)) and not isinstance(given, bool):
            return float(given)
        return float(self.reward) if self.reward is not None else NO_REWARD

    async def _next(self) -> Turn | None:
        """The next request, or None once the agent has ended (its failure raised)."""
        getting = asyncio.ensure_future(self.requests.get())
        try:
            await asyncio.wait([getting, self.ended], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getting.done():
                getting.cancel()
        if getting.done() and not getting.cancelled():
            self.current = getting.result()
            return self.conversation.turn(self.current)
        self.ended.result()  # raises the agent's failure
        return None

    def close(self, reason: str = "") -> None:
        """The task ended (the session ended, failed or was dropped): the agent is stopped and
        every request still waiting is answered 409."""
        if not self.ended.done():
            self.ended.set_exception(AgentFailed(reason or "the task ended"))
            self.ended.exception()  # retrieved: nobody may wait on it any more
        self._shut()

    def _end(self, reward: float | None) -> None:
        if not self.ended.done():
            self.ended.set_result(reward)
        self._shut()

    def _fail(self, reason: str) -> None:
        if not self.ended.done():
            self.ended.set_exception(AgentFailed(reason))
        self._shut()

    def _expire(self) -> None:
        self._fail(f"the agent passed its deadline ({self.deadline_s:g} s, env.agent_timeout_s)")

    def _shut(self) -> None:
        self.closed = True
        for session_id in self.session_ids:
            if self.sessions.get(session_id) is self:
                del self.sessions[session_id]
        if self._deadline is not None:
            self._deadline.cancel()
        closed = TaskClosed(f"task {short(self.task.task_id)} has ended")
        pending = [self.current] if self.current else []
        while not self.requests.empty():
            pending.append(self.requests.get_nowait())
        for request in pending:
            if not request.answer.done():
                request.answer.set_exception(closed)
                request.answer.exception()
        self.current = None
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()
        if self._process is not None and self._process.returncode is None:
            _kill(self._process)

    async def _run(self, launch: Callable[[AgentRun], Awaitable[float | None]]) -> None:
        try:
            reward = await launch(self)
        except asyncio.CancelledError:
            return
        except AgentFailed as exc:
            self._fail(str(exc))
        except Exception as exc:  # the agent's own failure ends its task, never the service
            self._fail(f"the agent raised {type(exc).__name__}: {short(str(exc), 300)}")
        else:
            self._end(reward)


# ------------------------------------------------------------------------------ launching


def load_entry(entry: str) -> Callable[..., Awaitable[Any]]:
    """The async function ``package.module:function`` names (ValueError if it is not one)."""
    module_name, _, name = entry.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"agent entry {short(entry)}: {exc}") from exc
    if not inspect.iscoroutinefunction(function):
        raise ValueError(f"agent entry {short(entry)}: expected an async function "
                         "(async def f(task, client))")
    return function


_entry_run: contextvars.ContextVar[AgentRun | None] = contextvars.ContextVar(
    "tiderl_entry_run", default=None)


def name_session(session_id: str) -> None:
    """From an entry agent (its task, or one it started): requests at the endpoint's root whose
    ``X-Session-ID`` is ``session_id`` are this task's, with or without its key. For a client
    shared by many tasks that names each task's requests by a session id of its own (verifiers'
    TrainClient sends its trace id). The id stands for the task's key: it must be unguessable
    (16 characters or more). Forgotten when the task ends."""
    run = _entry_run.get()
    if run is None:
        raise RuntimeError("name_session is called by an entry agent, in its own task")
    run.name_session(session_id)


async def run_entry(run: AgentRun) -> float | None:
    """An entry agent: ``await function(task, openai.AsyncOpenAI(...))`` in this process. Its
    client calls the service's app in-process (``run.local_app``, an ASGI transport: no socket,
    no TLS context to build per task) where the service has one, else over HTTP."""
    function = load_entry(run.config.entry)
    _entry_run.set(run)  # this coroutine runs in a task of its own (AgentRun.start)
    import httpx
    import openai

    transport = httpx.ASGITransport(app=run.local_app) if run.local_app is not None else None
    http = httpx.AsyncClient(transport=transport, timeout=run.deadline_s)
    async with openai.AsyncOpenAI(base_url=run.task.base_url, api_key=run.task.api_key,
                                  max_retries=2, http_client=http) as client:
        reward = await function(run.task, client)
    if reward is not None and not isinstance(reward, (int, float)):
        raise AgentFailed(f"the agent returned {type(reward).__name__}, expected a reward "
                          "(a number) or None")
    return reward


async def run_command(run: AgentRun) -> float | None:
    """A command agent: a process of its own (and its children: killed as a group), the task in
    its environment; the reward on its last stdout line."""
    task = run.task
    env = {**os.environ, "OPENAI_BASE_URL": task.base_url, "OPENAI_API_KEY": task.api_key,
           "ANTHROPIC_BASE_URL": task.anthropic_base_url, "ANTHROPIC_API_KEY": task.api_key,
           "TIDERL_TASK": task.to_json()}
    try:
        process = await asyncio.create_subprocess_exec(
            *shlex.split(run.config.command), env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=sys.stderr, start_new_session=True)
    except OSError as exc:
        raise AgentFailed(f"the agent did not start: {exc}") from exc
    run._process = process
    try:
        stdout, _ = await process.communicate()
    except asyncio.CancelledError:
        _kill(process)
        raise
    if process.returncode != 0:
        raise AgentFailed(f"the agent exited with code {process.returncode}")
    return last_line_reward(stdout.decode(errors="replace"))


def last_line_reward(stdout: str) -> float | None:
    """``{"reward": r}`` on the last non-empty line, else None (the reward route's, or 0)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        reward = json.loads(lines[-1]).get("reward")
    except (ValueError, AttributeError):
        return None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return None
    return float(reward)


def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def prewarm(configs: list[AgentConfig]) -> None:
    """Load what the first task's agent would otherwise load in its first turn: each entry's
    module, and the OpenAI SDK's request and response paths (one chat completion with a tool,
    answered in-process by a canned reply)."""
    entries = [config.entry for config in configs if config.entry]
    for entry in entries:
        load_entry(entry)
    if entries:
        asyncio.run(_one_sdk_call())


async def _one_sdk_call() -> None:
    import httpx
    import openai

    canned = {"id": "warm", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                           "message": {"role": "assistant", "content": "ok"}}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    tool = {"type": "function", "function": {"name": "f", "description": "",
                                             "parameters": {"type": "object"}}}
    http = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(
        200, json=canned)))
    async with openai.AsyncOpenAI(base_url="http://warm/v1", api_key="k", http_client=http,
                                  max_retries=0) as client:
        await client.chat.completions.create(
            model="m", tools=[tool], messages=[
                {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f",
                                                                 "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "r"}])


def launcher(config: AgentConfig) -> Callable[[AgentRun], Awaitable[float | None]]:
    return run_entry if config.entry else run_command


def new_key() -> str:
    return "tdr-" + secrets.token_urlsafe(18)
