"""One task's multi-turn loop on a rollout rank: environment observation in, model action out.

Each turn sends the whole context so far (the engine's prefix cache, kept resident by CTB's pins,
makes that cheap) and appends the observation that comes back. The trajectory keeps, per turn,
the new context tokens, the model's output tokens with their behaviour logprobs and the policy
version that produced them: exactly what the trainer consumes (``TrainSample.from_trajectory``).
The context is append-only: the model's output ids stay as sampled, and only the new messages
of a turn are encoded (:mod:`tiderl.models.chat`: the chat template where the model folder has
one, else the observation text).

A model that reads images (``placer``) gets each observation's screenshots among the new tokens
as placeholder runs (:mod:`tiderl.models.image_turns`), the PNG bytes kept once per task by
content hash. The one exception to append-only: before a turn, the screenshot window
(``image_window``) may drop the oldest images from the context; that turn then starts from the
whole pruned context (``restart``) and opens a new training segment
(:mod:`tiderl.core.segments`). The KV before the first dropped image stays valid, so the
engine's prefix cache serves it.

CTB pauses and resumes whole tasks. ``pause`` takes effect at the task's next turn boundary: the
loop unpins the task's KV (when it pins), pauses the environment session (so its idle timeout
stops), waits for ``resume``, resumes the session and goes on with the same context; that next
request carries ``RESUMED_PRIORITY``, so engines that schedule by priority run it first. A task
paused while its environment works on its action (CTB releases tasks that wait long) is unpinned
at once, so its blocks can serve other tasks during the wait.

A task can also leave the rank (ERS moved the rank to the trainer): ``detach`` stops it at its
next turn boundary and ``run`` raises :class:`TaskDetachedError` with a :class:`TaskCarry` (the open
environment session, the turns so far, the next context), from which another rank's loop goes on.

An agent task (a profile's ``env.agents``, :mod:`tiderl.env.agents`) is played the same way: its
session's opening and observations are its agent's model requests, and each step sends the
model's answer (``Completion``: the ids as sampled, their logprobs, why it ended). A request may
ask for fewer tokens, stop strings or token ids, or a seed (``sampling``, honoured for that turn;
temperature and top_p stay the job's); one that does not extend the conversation comes as a
``restart``, rendered whole as a new training segment; one whose prompt leaves no room in the
context is answered with an error (the agent gets a 400) and the task goes on.

A pin the engine refuses (:class:`PinRefused`: too little KV left beside the other pins) leaves
the task unpinned for that turn; it goes on. A pin is taken while the environment plays the
turn's action (it waits for the engine's step in flight; the environment need not). When a task
ends here (done, a cap, a failure, or detached), the loop tells the engine to ``forget`` it (its
pin and remembered context dropped), so the engine's per-task state lives only as long as the
task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import msgspec

from tiderl.core.segments import ImageWindow, drop_images
from tiderl.core.step_control import reusable_tokens
from tiderl.core.types import ImageRef, Trajectory, Turn
from tiderl.engine.clients import EngineClient, PinRefused
from tiderl.engine.request import SamplingParams
from tiderl.env.client import EnvClient
from tiderl.env.protocol import Completion, Message, ObservationResponse
from tiderl.models.chat import TurnEncoder
from tiderl.models.image_turns import ImagePlacer, PlacedTurn

T = TypeVar("T")
log = logging.getLogger("tiderl.agent")
RESUMED_PRIORITY = -1  # a task CTB resumed goes first where the engine schedules by priority


@dataclass(frozen=True)
class AgentTask:
    task_id: str
    group_id: str
    env: str
    task: str | None = None
    seed: int = 0
    eval: bool = False


@dataclass(frozen=True)
class TurnEvent:
    """Reported twice a turn, what CTB needs to track a task: after the generation (``running``
    False: the task now waits for its environment) and after the observation (``running`` True
    unless ``done``: the next generation starts)."""

    task_id: str
    context_tokens: int  # the whole context after this turn (prompt + every output so far)
    output_tokens: int  # this turn's
    version: int
    done: bool
    running: bool
    # after a generation: of the context the task's previous turn left in this engine's KV at
    # this version, its full blocks (``reusable_tokens``), what the engine found cached
    # (``reused_tokens``); 0 and 0 on a first turn, after a weight update or a move
    reused_tokens: int = 0
    reusable_tokens: int = 0


@dataclass
class TaskCarry:
    """A task in flight, movable to another rank: its environment session, the turns played and
    the context the next turn starts from (everything since the last output; the images among
    it, and whether the window pruned the context, which then is all of it), with the PNG bytes
    of the task's images by content hash."""

    session: str
    turns: list[Turn]
    next_context: list[int]
    next_images: list[ImageRef] = field(default_factory=list)
    next_restart: bool = False
    image_data: dict[str, bytes] = field(default_factory=dict)
    next_sampling: dict[str, Any] = field(default_factory=dict)  # an agent's next request's


class EngineUnreachableError(Exception):
    """The engine did not answer (a server that is gone): no task can go on here."""


async def _reach(call: Awaitable[T]) -> T:
    """An engine call; no answer at all (a 4xx or 5xx is one) is EngineUnreachableError."""
    try:
        return await call
    except httpx.TransportError as exc:
        raise EngineUnreachableError(f"engine unreachable: {exc!r}") from exc


class TaskDetachedError(Exception):
    """``run`` stopped at a turn boundary because the task was detached."""

    def __init__(self, task_id: str, carry: TaskCarry):
        super().__init__(f"task {task_id} detached")
        self.task_id = task_id
        self.carry = carry


class AgentLoop:
    def __init__(self, engine: EngineClient, env: EnvClient, encoder: TurnEncoder,
                 sampling: SamplingParams, *, max_turns: int, max_context_tokens: int,
                 version: Callable[[], int] = lambda: 0,
                 on_turn: Callable[[TurnEvent], None] | None = None, pin: bool = False,
                 record: bool = False, placer: ImagePlacer | None = None,
                 image_window: ImageWindow | None = None, agents: Collection[str] = (),
                 agent_wait_s: float = 600.0, block_size: int = 16):
        """``placer``: the model reads images (else an observation's images stay out of its
        context: their text marker is all it sees); ``image_window``: the screenshot sliding
        window applied to the context before each turn (:mod:`tiderl.core.segments`);
        ``agents``: the envs that are agents (``env.agents``), whose start and steps may take
        up to ``agent_wait_s`` (their agent thinks and runs its tools meanwhile);
        ``block_size``: the engine's KV block, the unit its prefix cache keeps a context in."""
        self.agents = frozenset(agents)
        self.agent_wait_s = agent_wait_s
        self.engine, self.env, self.encoder = engine, env, encoder
        self.placer = placer
        self.image_window = image_window
        self.sampling = sampling
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self.version = version  # for backends that do not report the version they sampled with
        self.block_size = block_size
        self.on_turn = on_turn
        self.pin = pin  # keep each task's KV pinned between its turns (CTB)
        self._running: dict[str, asyncio.Event] = {}
        self._in_env: dict[str, asyncio.Future] = {}  # task -> its pin, while its env steps
        self._unpins: set[asyncio.Task] = set()  # unpins of tasks paused in their env step
        self._detached: set[str] = set()
        # ``record``: per task, each turn played here as the environment and the engine saw it
        # (the messages before the generation, the prompt tokens the engine counted); taken by
        # ``take_transcript`` when the task ends (logging.rollouts)
        self.record = record
        self.transcripts: dict[str, list[dict]] = {}

    def pause(self, task_id: str) -> None:
        self._gate(task_id).clear()
        pinning = self._in_env.get(task_id)
        if pinning is not None:  # its environment is working: unpin now, not after
            unpin = asyncio.ensure_future(self._unpin_paused(task_id, pinning))
            self._unpins.add(unpin)
            unpin.add_done_callback(self._unpins.discard)

    async def _unpin_paused(self, task_id: str, pinning: asyncio.Future) -> None:
        """Unpin a task paused during its environment step, once its pin is taken (unless it
        was resumed meanwhile)."""
        await asyncio.gather(pinning, return_exceptions=True)
        gate = self._running.get(task_id)
        if gate is None or gate.is_set():  # ended, or resumed meanwhile
            return
        try:
            await _reach(self.engine.unpin(task_id))
        except Exception as exc:  # the turn boundary unpins it again
            log.info("task %s: unpin on pause: %r", task_id, exc)

    def resume(self, task_id: str) -> None:
        self._gate(task_id).set()

    def is_paused(self, task_id: str) -> bool:
        return not self._gate(task_id).is_set()

    def detach(self, task_id: str) -> None:
        """Stop the task at its next turn boundary (now, if it is paused)."""
        self._detached.add(task_id)
        self._gate(task_id).set()

    def _gate(self, task_id: str) -> asyncio.Event:
        gate = self._running.get(task_id)
        if gate is None:
            gate = self._running[task_id] = asyncio.Event()
            gate.set()
        return gate

    async def _wait_if_paused(self, task_id: str, session: str) -> bool:
        """Whether the task was paused (and is now resumed)."""
        gate = self._gate(task_id)
        if gate.is_set():
            return False
        if self.pin:
            await _reach(self.engine.unpin(task_id))
        await self.env.pause(session)
        await gate.wait()
        if task_id not in self._detached:
            await self.env.resume(session)  # a detached task's next rank resumes the session
        return True

    async def _pin(self, task_id: str) -> None:
        """Keep the task's KV until its next turn, unless the engine refuses (then it is not
        pinned, and goes on)."""
        try:
            await _reach(self.engine.pin(task_id))
        except PinRefused as exc:
            log.info("task %s goes on unpinned: %s", task_id, exc)

    async def _step_pinned(self, task_id: str, session: str, text: str,
                           completion: Completion | None, wait_s: float | None
                           ) -> ObservationResponse:
        """The environment step of a turn, the task's KV pinned meanwhile (when it pins): the
        pin waits for the engine's step in flight, the environment does not wait for the pin.
        The pin is done before this returns, whatever the step did."""
        if not self.pin:
            return await self.env.step(session, text, completion, wait_s=wait_s)
        pinning = asyncio.ensure_future(self._pin(task_id))
        self._in_env[task_id] = pinning
        try:
            step = await self.env.step(session, text, completion, wait_s=wait_s)
        except BaseException:
            await asyncio.gather(pinning, return_exceptions=True)  # forget() comes after it
            raise
        finally:
            del self._in_env[task_id]
        await pinning
        return step

    async def _forget(self, task_id: str) -> None:
        """The task ended here: the engine drops its state (a failure only leaves it to the
        engine's own bound)."""
        try:
            await self.engine.forget(task_id)
        except Exception as exc:  # cleanup: never hides why the task ended
            log.warning("task %s: the engine did not forget it: %r", task_id, exc)

    def _note(self, task_id: str, **entry: object) -> None:
        if self.record:
            self.transcripts.setdefault(task_id, []).append(entry)

    def take_transcript(self, task_id: str) -> list[dict]:
        """The task's recorded turns here (empty unless ``record``), dropped from the loop."""
        return self.transcripts.pop(task_id, [])

    def _report(self, task_id: str, context: int, output: int, version: int, done: bool,
                running: bool, reused: int = 0, reusable: int = 0) -> None:
        if self.on_turn is not None:
            self.on_turn(TurnEvent(task_id, context, output, version, done, running, reused,
                                   reusable))

    async def run(self, task: AgentTask, carry: TaskCarry | None = None) -> Trajectory:
        """Play the task to its end (done, the turn cap or the context cap; the last two score
        0) and return its trajectory with the reward; from ``carry`` when it moved here."""
        is_agent = task.env in self.agents
        wait = self.agent_wait_s if is_agent else None
        if carry is None:
            start = await self.env.start(task.env, task.task, task.seed, task_id=task.task_id,
                                         group_id=task.group_id, wait_s=wait)
            messages = _plain(start.messages)
            if start.prompt_ids is not None:  # a token-in agent renders its own prompt
                placed = PlacedTurn(list(start.prompt_ids))
            else:
                placed = self._encode(start.messages, start.observation, lambda text:
                                      self.encoder.opening(text, messages, start.tools))
            carry = TaskCarry(start.session, [], placed.ids, placed.images,
                              image_data=placed.data, next_sampling=dict(start.sampling))
            self._note(task.task_id, messages=messages, tools=start.tools)
        else:
            await self.env.resume(carry.session)
        session = carry.session
        trajectory = Trajectory(task.task_id, task.group_id, reward=0.0, turns=list(carry.turns),
                                image_data=dict(carry.image_data))
        context, live = open_context(trajectory.turns)
        new_context, new_images = list(carry.next_context), list(carry.next_images)
        restart, asked = carry.next_restart, carry.next_sampling
        ended, engine_gone = True, False
        kept_version: int | None = None  # the version `context` was computed at, here
        try:
            while len(trajectory.turns) < self.max_turns:
                resumed = await self._wait_if_paused(task.task_id, session)
                if task.task_id in self._detached:
                    ended = False
                    await self._forget(task.task_id)
                    await self.env.pause(session)
                    raise TaskDetachedError(task.task_id, TaskCarry(
                        session, trajectory.turns, new_context, new_images, restart,
                        trajectory.image_data, asked))
                prompt = context + new_context
                images = live + [image.shifted(len(context)) for image in new_images]
                drop = self.image_window.to_drop(len(images)) if self.image_window else 0
                if drop:  # a new training segment, from the pruned context
                    prompt, images = drop_images(prompt, images, drop)
                    new_context, new_images, restart = prompt, images, True
                sampling = self._turn_sampling(asked, len(prompt), is_agent)
                if sampling is None and not is_agent:
                    break
                if sampling is None:  # the agent is told; its task goes on
                    step = await self.env.step(session, "", Completion(error=(
                        f"the prompt is {len(prompt)} tokens, which leaves no room in the "
                        f"context length ({self.max_context_tokens} tokens)")), wait_s=wait)
                else:
                    out = await _reach(self.engine.generate(
                        task.task_id, prompt, sampling, RESUMED_PRIORITY if resumed else 0,
                        images=[(image, trajectory.image_data[image.key]) for image in images]))
                    version = out.version if out.version is not None else self.version()
                    output_ids, logprobs = out.output_ids, out.logprobs
                    text, stop = self.encoder.decode(output_ids), ""
                    if asked.get("stop"):
                        output_ids, logprobs, text, stop = cut_at_stop(
                            self.encoder.decode, output_ids, logprobs, asked["stop"])
                    trajectory.turns.append(Turn(new_context, output_ids, logprobs, version,
                                                 tuple(new_images), restart))
                    self._note(task.task_id, turn=len(trajectory.turns) - 1,
                               prompt_tokens=out.num_prompt_tokens, output_ids=output_ids)
                    reusable = reusable_tokens(len(context), self.block_size) \
                        if kept_version == version and not drop else 0
                    reused = min(out.num_cached_tokens, reusable)
                    context, live, restart = prompt + output_ids, images, False
                    kept_version = version
                    self._report(task.task_id, len(context), len(output_ids), version,
                                 False, False, reused, reusable)
                    completion = Completion(
                        output_ids, logprobs, "length" if not stop and "length" in
                        out.finish_reason.lower() else "stop", out.num_prompt_tokens,
                        out.num_cached_tokens, version, stop) if is_agent else None
                    step = await self._step_pinned(task.task_id, session, text, completion,
                                                   wait)
                    self._report(task.task_id, len(context), len(output_ids), version,
                                 step.done, not step.done)
                if step.done:
                    trajectory.reward = step.reward
                    break
                messages = _plain(step.messages)
                asked = dict(step.sampling)
                if step.restart:  # the agent's request does not extend the context: a new
                    context, live, restart = [], [], True  # training segment, rendered whole
                    placed = PlacedTurn(list(step.prompt_ids)) if step.prompt_ids is not None \
                        else self._encode(step.messages, step.observation, functools.partial(
                            self.encoder.opening, messages=messages, tools=step.tools))
                elif step.prompt_ids is not None:
                    placed = PlacedTurn(list(step.prompt_ids))
                else:
                    last = trajectory.turns[-1].output_ids if trajectory.turns else []
                    placed = self._encode(step.messages, step.observation, functools.partial(
                        self.encoder.following, messages=messages, output_ids=last))
                new_context, new_images = placed.ids, placed.images
                trajectory.image_data.update(placed.data)
                self._note(task.task_id, messages=messages)
        except EngineUnreachableError:
            engine_gone = True
            raise
        finally:
            self._running.pop(task.task_id, None)
            self._detached.discard(task.task_id)
            if ended:
                if not engine_gone:
                    await self._forget(task.task_id)
                await self.env.end(session)
            else:  # it goes on elsewhere: its record there starts at its next turn
                self.transcripts.pop(task.task_id, None)
        return trajectory

    def _turn_sampling(self, asked: dict[str, Any], prompt_tokens: int,
                       is_agent: bool) -> SamplingParams | None:
        """The job's sampling with what an agent's request asks for this turn (fewer tokens,
        stop token ids, a seed); None when the prompt leaves too little room in the context
        (a native task: no room for the job's ``max_tokens``; an agent's: no room at all)."""
        room = self.max_context_tokens - prompt_tokens
        base = self.sampling
        max_tokens = min(base.max_tokens, asked.get("max_tokens") or base.max_tokens)
        if max_tokens > room:
            if not is_agent or room <= 0:
                return None
            max_tokens = room
        if not asked and max_tokens == base.max_tokens:
            return base
        return dataclasses.replace(
            base, max_tokens=max_tokens, seed=asked.get("seed", base.seed),
            stop_token_ids=tuple(asked.get("stop_token_ids", base.stop_token_ids)))

    def _encode(self, messages: list[Message], text: str,
                encode: Callable[[str], list[int]]) -> PlacedTurn:
        """A turn's new ids (``encode`` of its text) with the messages' images placed among
        them, for a model that reads images; otherwise the ids as they are."""
        images = [png for message in messages for png in message.images()]
        if self.placer is None or not images:
            return PlacedTurn(encode(text))
        if not self.placer.templated:  # the placeholders stand for the images, not a marker
            text = "\n".join(t for message in messages if (t := message.text(image_marker="")))
        return self.placer.place(encode(text), images)


def open_context(turns: list[Turn]) -> tuple[list[int], list[ImageRef]]:
    """The context the turns leave (every id since the last ``restart`` turn, whose context is
    the whole pruned one) and the images among it."""
    start = max((k for k, turn in enumerate(turns) if turn.restart), default=0)
    ids: list[int] = []
    images: list[ImageRef] = []
    for turn in turns[start:]:
        images += [image.shifted(len(ids)) for image in turn.images]
        ids += turn.context_ids + turn.output_ids
    return ids, images


def cut_at_stop(decode: Callable[[list[int]], str], output_ids: list[int],
                logprobs: list[float], stops: Sequence[str]
                ) -> tuple[list[int], list[float], str, str]:
    """The output up to the first of ``stops`` in its text, as vLLM stops: the ids through the
    token that completes the stop string (exactly as sampled), their logprobs, the text before
    the stop string, and the stop string ("" if none occurs: everything as it is)."""
    text = decode(output_ids)
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    if not found:
        return output_ids, logprobs, text, ""
    at, stop = min(found)
    lo, hi = 1, len(output_ids)  # the fewest ids whose text holds the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(output_ids[:mid])) >= at + len(stop):
            hi = mid
        else:
            lo = mid + 1
    return output_ids[:lo], logprobs[:lo], text[:at], stop


def _plain(messages: list[Message]) -> list[dict]:
    """Messages as the dicts a chat template reads (a tool call's JSON arguments as an object,
    as templates expect them)."""
    plain = msgspec.to_builtins(messages)
    for message in plain:
        for call in message.get("tool_calls") or ():
            try:
                arguments = json.loads(call["function"]["arguments"])
            except (ValueError, RecursionError):
                continue
            if isinstance(arguments, dict):
                call["function"]["arguments"] = arguments
    return plain
