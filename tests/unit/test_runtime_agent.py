"""The agent loop with the embedded engine and in-process environments (no mocks)."""

from __future__ import annotations

import asyncio

from tiderl.engine.clients import EmbeddedClient
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.request import SamplingParams
from tiderl.env.client import InProcessEnvClient
from tiderl.env.config import EnvConfig
from tiderl.env.sessions import SessionState
from tiderl.models.chat import PlainEncoder
from tiderl.models.config import ModelConfig
from tiderl.models.tokenizer import word_tokenizer
from tiderl.runtime.agent import AgentLoop, AgentTask, TaskDetachedError, TurnEvent

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0, seed=0)


def _loop(events: list[TurnEvent], max_turns: int = 4, max_context: int = 4096):
    engine = LLMEngine.from_configs(ModelConfig(), EngineConfig(kv_cache_tokens=4096))
    env = InProcessEnvClient(EnvConfig(envs=["guess"]))
    return AgentLoop(EmbeddedClient(engine), env, PlainEncoder(word_tokenizer()), SAMPLING,
                     max_turns=max_turns, max_context_tokens=max_context,
                     on_turn=events.append), env


def test_trajectory_rebuilds_every_turns_prompt_and_reports_each_turn():
    events: list[TurnEvent] = []
    loop, _ = _loop(events)
    tasks = [AgentTask(f"t{i}", "g0", "guess", "1 100", seed=i) for i in range(3)]

    async def play():
        return await asyncio.gather(*(loop.run(t) for t in tasks))

    trajectories = asyncio.run(play())
    for task, trajectory in zip(tasks, trajectories, strict=True):
        assert trajectory.task_id == task.task_id and trajectory.group_id == "g0"
        assert 1 <= len(trajectory.turns) <= 4
        assert trajectory.reward is not None and 0.0 <= trajectory.reward <= 1.0
        mine = [e for e in events if e.task_id == task.task_id]
        assert len(mine) == 2 * len(trajectory.turns)  # after the generation, after the env
        assert [e.running for e in mine[1::2]] == [not e.done for e in mine[1::2]]
        mine = mine[::2]
        assert not any(e.running or e.done for e in mine)
        context = 0
        for turn, event in zip(trajectory.turns, mine, strict=True):
            assert turn.context_ids and 1 <= len(turn.output_ids) <= SAMPLING.max_tokens
            assert len(turn.logprobs) == len(turn.output_ids)
            assert all(lp <= 0.0 for lp in turn.logprobs)
            # the previous turn's context, to its last token, in whole 16-token blocks: all of
            # it still cached (three short tasks in a 4,096-token pool)
            kept = max(0, context - 1) // 16 * 16
            assert (event.reused_tokens, event.reusable_tokens) == (kept, kept)
            context += len(turn.context_ids) + len(turn.output_ids)
            assert event.context_tokens == context  # the whole context after this turn
        ids, mask, _, _ = trajectory.flatten()
        assert len(ids) == context and sum(mask) == trajectory.num_output_tokens
    assert any(e.reusable_tokens for e in events)  # some task played a second turn


def test_pause_holds_the_task_at_its_turn_boundary_until_resume():
    """The pause comes while the first turn is under way (from its first report, after the
    generation): that turn's environment step is still played, then the task holds; while it
    holds, another task plays its whole game on the same engine and the held one plays nothing."""
    events: list[TurnEvent] = []
    loop, env = _loop(events, max_turns=3)
    task = AgentTask("p", "g", "guess", "1 1000", seed=1)

    async def scenario():
        boundary = asyncio.Event()

        def on_turn(event: TurnEvent) -> None:
            events.append(event)
            if event.task_id == "p" and _num_events(events, "p") == 1:
                loop.pause("p")
            elif event.task_id == "p" and _num_events(events, "p") == 2:
                boundary.set()  # the turn under way when the pause came is played out

        loop.on_turn = on_turn
        running = asyncio.create_task(loop.run(task))
        await boundary.wait()
        other = await loop.run(AgentTask("q", "g", "guess", "1 1000", seed=5))
        held = _num_events(events, "p")
        paused_sessions = [s for s in env.service.table.sessions.values()
                           if s.state is SessionState.PAUSED]
        loop.resume("p")
        trajectory = await running
        return held, len(paused_sessions), other, trajectory

    held, num_paused, other, trajectory = asyncio.run(scenario())
    assert held == 2  # the turn already under way when the pause came (2 events), no more
    assert _num_events(events, "q") == 2 * len(other.turns) >= 2  # played meanwhile
    assert num_paused == 1  # the environment session was paused while the task waited
    assert 2 * len(trajectory.turns) >= held


def _num_events(events: list[TurnEvent], task_id: str) -> int:
    return sum(1 for e in events if e.task_id == task_id)


def test_context_cap_ends_the_task_with_reward_zero():
    events: list[TurnEvent] = []
    loop, _ = _loop(events, max_turns=20, max_context=40)
    trajectory = asyncio.run(loop.run(AgentTask("c", "g", "guess", "1 1000", seed=2)))
    assert trajectory.reward == 0.0 and 1 <= len(trajectory.turns) < 20
    assert len(events) == 2 * len(trajectory.turns) and not events[-1].done
    assert events[-1].context_tokens <= 40  # every generated turn fitted under the cap


def test_a_detached_task_goes_on_from_its_carry_on_another_loop():
    """ERS moved the rank: the task stops at a turn boundary and another loop (another engine)
    finishes it in the same environment session, keeping the turns already played."""
    events: list[TurnEvent] = []
    first, env = _loop(events, max_turns=6)
    engine = LLMEngine.from_configs(ModelConfig(), EngineConfig(kv_cache_tokens=4096))
    second = AgentLoop(EmbeddedClient(engine), env, PlainEncoder(word_tokenizer()), SAMPLING,
                       max_turns=6, max_context_tokens=4096, on_turn=events.append)
    task = AgentTask("d", "g", "guess", "1 1000", seed=3)

    def on_turn(event: TurnEvent) -> None:
        events.append(event)
        if len(events) == 2:  # the first turn played: it stops at the boundary that follows
            first.detach("d")

    first.on_turn = on_turn

    async def scenario():
        running = asyncio.create_task(first.run(task))
        try:
            await running
        except TaskDetachedError as exc:
            carry = exc.carry
        else:
            raise AssertionError("run returned instead of raising TaskDetachedError")
        sessions = {k: v.state for k, v in env.service.table.sessions.items()}
        played = len(carry.turns)
        trajectory = await second.run(task, carry)
        return carry, played, sessions, trajectory

    carry, played, sessions, trajectory = asyncio.run(scenario())
    assert played >= 1 and carry.next_context
    assert sessions[carry.session] is SessionState.PAUSED  # kept open for the next rank
    assert trajectory.turns[:played] == carry.turns[:played]
    assert len(trajectory.turns) > played or trajectory.reward is not None
    assert carry.session not in env.service.table.sessions  # ended by the second loop


def test_a_refused_pin_leaves_the_task_unpinned_and_an_ended_task_leaves_no_engine_state():
    engine = LLMEngine.from_configs(ModelConfig(), EngineConfig(kv_cache_tokens=256))
    kv = engine.scheduler.kv_cache
    loop = AgentLoop(EmbeddedClient(engine), InProcessEnvClient(EnvConfig(envs=["guess"])),
                     PlainEncoder(word_tokenizer()), SAMPLING, max_turns=3, max_context_tokens=256,
                     pin=True)
    pinned_now: list[bool] = []
    loop.on_turn = lambda event: pinned_now.append(kv.is_pinned(event.task_id))

    async def scenario():
        free = await loop.run(AgentTask("free", "g", "guess", "1 1000", seed=4))
        for i in range(kv.pool.num_blocks):  # every block has a pinned task: pins are refused
            engine.pin(f"hog{i}")
        blocked = await loop.run(AgentTask("blocked", "g", "guess", "1 1000", seed=4))
        return free, blocked

    free, blocked = asyncio.run(scenario())
    turns = len(free.turns)
    # pinned each turn, by the time the environment played its action (the pin is taken
    # meanwhile: the second report of a turn)
    assert turns >= 1 and pinned_now[1:2 * turns:2] == [True] * turns
    assert 1 <= len(blocked.turns) <= 3 and blocked.reward is not None  # played on, unpinned
    assert pinned_now[2 * turns:] == [False] * (2 * len(blocked.turns))
    assert kv.task_ids == {f"hog{i}" for i in range(kv.pool.num_blocks)}  # the two: forgotten


class HeldEnvClient(InProcessEnvClient):
    """The in-process environment with each action's step held until ``go`` is set."""

    def __init__(self, config: EnvConfig) -> None:
        super().__init__(config)
        self.stepping, self.go = asyncio.Event(), asyncio.Event()

    async def step(self, *args, **kwargs):
        self.stepping.set()
        await self.go.wait()
        return await super().step(*args, **kwargs)


def test_a_task_paused_while_its_environment_works_is_unpinned_at_once():
    """CTB releases a task waiting for its environment: its KV is unpinned during the wait,
    not at the turn boundary after it; the task then holds until resumed and plays on."""
    engine = LLMEngine.from_configs(ModelConfig(), EngineConfig(kv_cache_tokens=1024))
    kv = engine.scheduler.kv_cache

    async def scenario():
        env = HeldEnvClient(EnvConfig(envs=["guess"]))
        loop = AgentLoop(EmbeddedClient(engine), env, PlainEncoder(word_tokenizer()), SAMPLING,
                         max_turns=3, max_context_tokens=1024, pin=True)
        running = asyncio.create_task(loop.run(AgentTask("p", "g", "guess", "1 1000", seed=1)))
        await env.stepping.wait()
        while not kv.is_pinned("p"):  # the pin is taken while the environment works
            await asyncio.sleep(0.01)
        loop.pause("p")
        while kv.is_pinned("p"):  # ... and dropped on the pause, the step still held
            await asyncio.sleep(0.01)
        held = not env.go.is_set()
        env.go.set()
        loop.resume("p")
        return held, await asyncio.wait_for(running, 120)

    held, trajectory = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert held and trajectory.reward is not None and len(trajectory.turns) >= 1
    assert kv.task_ids == set()  # ended: nothing left in the engine
