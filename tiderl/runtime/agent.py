"""One task's multi-turn loop on a rollout rank: environment observation in, model action out.

Each turn sends the whole context so far (the engine's prefix cache, kept resident by CTB's pins,
makes that cheap) and appends the observation that comes back. The trajectory keeps, per turn,
the new context tokens, the model's output tokens with their behaviour logprobs and the policy
version that produced them: exactly what the trainer consumes (``TrainSample.from_trajectory``).

CTB pauses and resumes whole tasks. ``pause`` takes effect at the task's next turn boundary: the
loop pauses the environment session (so its idle timeout stops), waits for ``resume``, resumes
the session and goes on with the same context.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from tiderl.core.types import Trajectory, Turn
from tiderl.engine.clients import EngineClient
from tiderl.engine.request import SamplingParams
from tiderl.env.client import EnvClient


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
    """Reported after every turn: what CTB needs to track the task's footprint."""

    task_id: str
    context_tokens: int  # the whole context after this turn (prompt + every output so far)
    output_tokens: int  # this turn's
    version: int
    done: bool


class AgentLoop:
    def __init__(self, engine: EngineClient, env: EnvClient, tokenizer: Tokenizer,
                 sampling: SamplingParams, *, max_turns: int, max_context_tokens: int,
                 version: Callable[[], int] = lambda: 0,
                 on_turn: Callable[[TurnEvent], None] | None = None):
        self.engine, self.env, self.tokenizer = engine, env, tokenizer
        self.sampling = sampling
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self.version = version  # for backends that do not report the version they sampled with
        self.on_turn = on_turn
        self._running: dict[str, asyncio.Event] = {}

    def pause(self, task_id: str) -> None:
        self._gate(task_id).clear()

    def resume(self, task_id: str) -> None:
        self._gate(task_id).set()

    def is_paused(self, task_id: str) -> bool:
        return not self._gate(task_id).is_set()

    def _gate(self, task_id: str) -> asyncio.Event:
        gate = self._running.get(task_id)
        if gate is None:
            gate = self._running[task_id] = asyncio.Event()
            gate.set()
        return gate

    async def _wait_if_paused(self, task_id: str, session: str) -> None:
        gate = self._gate(task_id)
        if gate.is_set():
            return
        await self.env.pause(session)
        await gate.wait()
        await self.env.resume(session)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    async def run(self, task: AgentTask) -> Trajectory:
        """Play the task to its end (done, the turn cap or the context cap; the last two score
        0) and return its trajectory with the reward."""
        start = await self.env.start(task.env, task.task, task.seed)
        trajectory = Trajectory(task.task_id, task.group_id, reward=0.0)
        context: list[int] = []
        new_context = self._encode(start.observation)
        try:
            for _ in range(self.max_turns):
                await self._wait_if_paused(task.task_id, start.session)
                prompt = context + new_context
                if len(prompt) + self.sampling.max_tokens > self.max_context_tokens:
                    break
                out = await self.engine.generate(task.task_id, prompt, self.sampling)
                version = out.version if out.version is not None else self.version()
                trajectory.turns.append(Turn(new_context, out.output_ids, out.logprobs, version))
                context = prompt + out.output_ids
                step = await self.env.step(start.session,
                                           self.tokenizer.decode(out.output_ids))
                if self.on_turn is not None:
                    self.on_turn(TurnEvent(task.task_id, len(context), len(out.output_ids),
                                           version, step.done))
                if step.done:
                    trajectory.reward = step.reward
                    break
                new_context = self._encode(step.observation)
        finally:
            self._running.pop(task.task_id, None)
            await self.env.end(start.session)
        return trajectory
