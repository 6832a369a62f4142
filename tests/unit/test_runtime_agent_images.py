"""The agent loop with a model that reads images (tiny Qwen2-VL, the embedded engine) on a
scripted screenshot episode: images placed among the tokens, the sliding window and the training
segments it cuts, and a task carried between ranks with its images (no mocks)."""

from __future__ import annotations

import asyncio
import io

import pytest
from PIL import Image

from tiderl.core.segments import ImageWindow
from tiderl.engine.clients import EmbeddedClient
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.request import SamplingParams
from tiderl.env.base import Environment, StepResult
from tiderl.env.client import InProcessEnvClient
from tiderl.env.config import EnvConfig
from tiderl.env.protocol import Message, TextPart, image_part
from tiderl.models.chat import PlainEncoder
from tiderl.models.config import ModelConfig
from tiderl.models.image_turns import image_placer
from tiderl.models.loading import model_from_config
from tiderl.runtime.agent import AgentLoop, AgentTask, TaskDetachedError, open_context
from tiderl.trainer.sample import TrainSample

TURNS = 7


def screenshot(k: int) -> bytes:
    """A 56 x 56 screenshot (4 LLM tokens), one colour per turn."""
    out = io.BytesIO()
    Image.new("RGB", (56, 56), (30 * k % 256, 255 - 20 * k, 7 * k)).save(out, "PNG")
    return out.getvalue()


class Screens(Environment):
    """A new screenshot every turn, done after ``TURNS`` actions with reward 1."""

    def reset(self, task, seed):
        self.turn = 0
        return self._screen(), {}

    def step(self, action):
        self.turn += 1
        return StepResult(self._screen(), 1.0 if self.turn == TURNS else 0.0,
                          self.turn == TURNS, {})

    def _screen(self):
        return [Message("user", [image_part(screenshot(self.turn)), TextPart("screen")])]


def _loop(window: ImageWindow, env: InProcessEnvClient | None = None) -> AgentLoop:
    """A rank's loop: its own engine; ``env``: the environment service (a new one)."""
    model, tokenizer = model_from_config(ModelConfig(size="tiny-vl"))
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=2048, block_size=4), None)
    encoder = PlainEncoder(tokenizer)
    env = env or InProcessEnvClient(EnvConfig(envs=[f"{__name__}:Screens"],
                                              max_turns=TURNS + 1))
    return AgentLoop(EmbeddedClient(engine), env, encoder,
                     SamplingParams(max_tokens=3, temperature=1.0, seed=0),
                     max_turns=TURNS + 1, max_context_tokens=2048,
                     placer=image_placer(None, model.config, encoder), image_window=window)


def keys(images) -> list[bytes]:
    return [screenshot(k) for k in images]


def test_the_window_prunes_and_each_pruning_opens_a_segment():
    """Window (4, 2): before turn 3 the context holds screens 0-3, so 0 and 1 go and turn 3
    opens segment 1 from the pruned context; turn 5 drops 2 and 3 the same way. Three
    segments, each with the screens its context held, its loss on its own turns only."""
    loop = _loop(ImageWindow(4, 2))
    trajectory = asyncio.run(loop.run(AgentTask("t0", "g0", f"{__name__}:Screens")))
    assert len(trajectory.turns) == TURNS and trajectory.reward == 1.0
    assert [t.restart for t in trajectory.turns] == [False, False, False, True, False, True,
                                                     False]
    assert sorted(trajectory.image_data.values()) == sorted(keys(range(TURNS)))
    samples = TrainSample.from_trajectory(trajectory, 1.0, trajectory.image_data)
    assert [s.seq_id for s in samples] == ["t0#0", "t0#1", "t0#2"]
    for sample, screens in zip(samples, ([0, 1, 2], [2, 3, 4], [4, 5, 6]), strict=True):
        assert sorted(sample.image_data[ref.key] for ref in sample.images) == \
            sorted(keys(screens))
        for ref in sample.images:  # each ref names its placeholder run in the sample's ids
            assert sample.input_ids[ref.offset - 1] == 1568  # vision start
            assert set(sample.input_ids[ref.offset:ref.offset + ref.num_tokens]) == {1570}
    turns_per_segment = [3, 2, 2]
    for sample, turns, first in zip(samples, turns_per_segment, (0, 3, 5), strict=True):
        outputs = [t for turn in trajectory.turns[first:first + turns] for t in turn.output_ids]
        assert [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m] == \
            outputs


def test_a_carried_task_goes_on_with_its_images():
    """Detached at a turn boundary past a pruning, the task goes on in another loop from its
    carry (turns, next context and images, PNG bytes): the same segments as a task that never
    moved."""
    first = _loop(ImageWindow(4, 2))
    second = _loop(ImageWindow(4, 2), first.env)
    task = AgentTask("t1", "g0", f"{__name__}:Screens")
    events = []
    first.on_turn = lambda event: (events.append(event), len(events) == 9
                                   and first.detach(task.task_id))

    async def play():
        with pytest.raises(TaskDetachedError) as moved:
            await first.run(task)
        return moved.value.carry, await second.run(task, moved.value.carry)

    carry, trajectory = asyncio.run(play())
    assert 0 < len(carry.turns) < TURNS and any(t.restart for t in carry.turns)
    assert open_context(carry.turns)[1]  # the carried context holds images
    assert [t.restart for t in trajectory.turns] == [False, False, False, True, False, True,
                                                     False]
    assert sorted(trajectory.image_data.values()) == sorted(keys(range(TURNS)))
