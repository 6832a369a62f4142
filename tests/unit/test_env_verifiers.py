"""The verifiers adapter's contract, against stand-ins written to verifiers' classic signatures.

verifiers is not installed here: 0.4.0, the current release, adds about 130 MB of packages and
no longer ships the classic MultiTurnEnv / ToolEnv interface (only ``verifiers.v1``), so the
classes below stand in for a user's environment. ``FakeVerifiersEnv`` follows the ToolEnv of
verifiers 0.1.14 and ``verifiers.legacy`` 0.3 (stop conditions read ``state["trajectory"]``,
messages and tool calls are objects, ``env_response`` returns messages, ``score_rollout(state)``
sets ``state["reward"]``); ``FakeOldVerifiersEnv`` the dict-based 0.1.x one
(``is_completed(messages, state)``, ``env_response`` returns ``(messages, state)``,
``score_rollout(prompt, completion, ...)`` returns the score); ``FakeSingleTurnEnv`` a
``SingleTurnEnv`` (``max_turns`` 1, no ``env_response``)."""

import asyncio
import base64
import io
import json
import re
from dataclasses import dataclass

import pytest
from PIL import Image

from tiderl.env.base import UnknownEnvironment
from tiderl.env.client import InProcessEnvClient, Message
from tiderl.env.config import EnvConfig
from tiderl.env.images import ImageError, png_size
from tiderl.env.registry import make_env
from tiderl.env.verifiers_adapter import VerifiersEnv

ROWS = [{"question": "What is 2 + 3?", "answer": "5"},
        {"question": "What is 40 + 2?", "answer": "42"},
        {"question": "What is 7 + 8?", "answer": "15", "info": json.dumps({"level": 2})}]


def answer_of(text: str) -> str | None:
    match = re.search(r"<answer>(.*?)</answer>", text or "")
    return match.group(1).strip() if match else None


@dataclass
class FakeToolMessage:
    """Stand-in for vf.ToolMessage (an object, not a dict)."""

    role: str
    content: str
    tool_call_id: str


class FakeRubric:
    """Stand-in for vf.Rubric: weighted reward functions called with named state fields."""

    def __init__(self):
        self.funcs = [self.correct_answer, self.num_turns]
        self.weights = [1.0, 0.0]

    async def correct_answer(self, completion, answer, **_) -> float:
        return float(answer_of(completion[-1].content) == answer)

    async def num_turns(self, state, **_) -> float:
        return float(len(state["trajectory"]))

    async def score_rollout(self, state):
        fields = {k: state[k] for k in ("prompt", "completion", "answer", "task", "info")}
        scores = [await f(state=state, **fields) for f in self.funcs]
        state["reward"] = sum(s * w for s, w in zip(scores, self.weights, strict=True))
        state["metrics"] = {f.__name__: s for f, s in zip(self.funcs, scores, strict=True)}


class FakeVerifiersEnv:
    """Stand-in for a vf.ToolEnv with one tool, ``add(a, b)``."""

    def __init__(self, rows=ROWS, system_prompt="Use the add tool, answer in <answer></answer>.",
                 max_turns=-1):
        self.dataset = rows
        self.system_prompt = system_prompt
        self.few_shot = None
        self.max_turns = max_turns
        self.tool_defs = [{"name": "add", "description": "a + b", "parameters": {
            "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}]
        self.rubric = FakeRubric()

    def get_dataset(self, n=-1, seed=None):
        return self.dataset

    async def setup_state(self, state):
        state["tool_uses"] = 0  # mutates, returns None (0.3 style)

    async def is_completed(self, state, **kwargs) -> bool:  # the no_tools_called stop condition
        await asyncio.sleep(0)  # really awaits: runs on a loop
        last = state["trajectory"][-1]["completion"][-1]
        return last.role == "assistant" and not last.tool_calls

    async def env_response(self, messages, state, **kwargs):
        out = []
        for call in messages[-1].tool_calls:
            args = json.loads(call.arguments)
            state["tool_uses"] += 1
            out.append(FakeToolMessage("tool", str(args["a"] + args["b"]), call.id))
        return out


class FakeOldVerifiersEnv:
    """Stand-in for a dict-based 0.1.x MultiTurnEnv: hints until the answer is right."""

    oai_tools = None

    def __init__(self):
        self.rubric = self
        self.max_turns = 10

    def get_dataset(self):
        return [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"],
                 "task": "sums"} for r in ROWS]

    async def is_completed(self, messages, state, **kwargs) -> bool:
        return answer_of(messages[-1]["content"]) == state["answer"]

    async def env_response(self, messages, state, **kwargs):
        state.setdefault("hints", 0)
        state["hints"] += 1
        return [{"role": "user", "content": f"not yet (hint {state['hints']})"}], state

    async def score_rollout(self, prompt, completion, answer, state, task, info):
        assert task == "sums"
        right = answer_of(completion[-1]["content"]) == answer
        return {"reward": 1.0 if right else 0.0, "metrics": {"hints": state.get("hints", 0)}}


class FakeSingleTurnEnv(FakeVerifiersEnv):
    def __init__(self):
        super().__init__(max_turns=1)

    async def env_response(self, messages, state, **kwargs):
        raise NotImplementedError("env_response is not implemented for SingleTurnEnv")


def image_url(color: tuple[int, int, int], kind: str) -> str:
    out = io.BytesIO()
    Image.new("RGB", (16, 8), color).save(out, format=kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(out.getvalue()).decode()


RED_JPEG, BLUE_PNG = image_url((250, 0, 0), "JPEG"), image_url((0, 0, 250), "PNG")


class FakeScreenEnv(FakeOldVerifiersEnv):
    """A dict-based env whose prompt holds a JPEG and whose responses hold a PNG screenshot."""

    def __init__(self, url=RED_JPEG):
        super().__init__()
        self.url = url
        self.seen: list = []

    def get_dataset(self):
        return [{"prompt": [{"role": "user", "content": [
            {"type": "text", "text": "Which color?"},
            {"type": "image_url", "image_url": {"url": self.url}}]}],
            "answer": "blue", "task": "colors"}]

    async def env_response(self, messages, state, **kwargs):
        self.seen = messages
        return [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": BLUE_PNG}},
            {"type": "text", "text": "and now?"}]}], state

    async def score_rollout(self, prompt, completion, answer, state, task, info):
        return {"reward": float(answer_of(completion[-1]["content"]) == answer)}


def load_screens(**kwargs):
    return FakeScreenEnv(**kwargs)


def load_environment(**kwargs):
    """What an installed verifiers environment module exposes."""
    return FakeVerifiersEnv(**kwargs)


def load_old(**kwargs):
    return FakeOldVerifiersEnv(**kwargs)


def load_single(**kwargs):
    return FakeSingleTurnEnv(**kwargs)


def load_not_classic(**kwargs):
    return object()


def add_call(a, b) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def test_a_tool_env_episode_reset_tool_call_answer_and_rubric_reward():
    env = make_env("verifiers:tests.unit.test_env_verifiers", max_turns=5)
    assert isinstance(env, VerifiersEnv)
    opening, info = env.reset("1", seed=0)
    assert opening == [Message("system", "Use the add tool, answer in <answer></answer>."),
                       Message("user", "What is 40 + 2?")]
    assert info == {"split": "train", "row": 1}
    assert env.tools == [{"type": "function", "function": {
        "name": "add", "description": "a + b", "parameters": {
            "type": "object", "properties": {"a": {"type": "number"},
                                             "b": {"type": "number"}}}}}]
    tool = env.step("I will add. " + add_call(40, 2))
    assert tool.observation == [Message("tool", "42", tool_call_id="call_0")]
    assert not tool.done and env.state["tool_uses"] == 1
    final = env.step("<answer>42</answer>")
    assert final.done and final.reward == 1.0
    assert final.info["metrics"] == {"correct_answer": 1.0, "num_turns": 2.0}
    assert env.step("again").done


def test_rows_by_seed_and_options_reach_load_environment():
    env = make_env("verifiers:tests.unit.test_env_verifiers:load_environment",
                   options={"system_prompt": ""})
    opening, info = env.reset(None, seed=5)
    assert opening == [Message("user", ROWS[5 % 3]["question"])] and info["row"] == 2
    assert env.state["info"] == {"level": 2}
    with pytest.raises(ValueError, match="expected empty, N"):
        env.reset("some words", seed=0)
    with pytest.raises(UnknownEnvironment, match="bad options"):
        make_env("verifiers:tests.unit.test_env_verifiers:load_environment",
                 options={"nope": 1})


def test_the_old_dict_signatures_and_the_turn_cap():
    env = make_env("verifiers:tests.unit.test_env_verifiers:load_old", max_turns=3)
    env.reset("0", seed=0)
    hint = env.step("<answer>4</answer>")
    assert hint.observation == [Message("user", "not yet (hint 1)")] and not hint.done
    won = env.step("<answer>5</answer>")
    assert (won.done, won.reward, won.info["metrics"]) == (True, 1.0, {"hints": 1.0})
    env.reset("0", seed=0)
    results = [env.step("<answer>0</answer>") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == 0.0 and results[-1].info["truncated"]


def test_a_single_turn_env_ends_after_one_reply_without_env_response():
    env = make_env("verifiers:tests.unit.test_env_verifiers:load_single")
    env.reset("0", seed=0)
    out = env.step("<answer>5</answer>")
    assert out.done and out.reward == 1.0 and out.observation == []


def test_names_that_are_not_classic_verifiers_environments_are_refused():
    with pytest.raises(UnknownEnvironment, match="not a classic verifiers environment"):
        make_env("verifiers:tests.unit.test_env_verifiers:load_not_classic")
    with pytest.raises(UnknownEnvironment, match="cannot import"):
        make_env("verifiers:no-such-environment")


def test_through_the_service_inside_a_running_event_loop():
    name = "verifiers:tests.unit.test_env_verifiers"

    async def main():
        client = InProcessEnvClient(EnvConfig(envs=[name]))
        started = await client.start(name, "2", seed=0)
        assert [m.role for m in started.messages] == ["system", "user"]
        assert started.observation.endswith("What is 7 + 8?")
        assert started.tools[0]["function"]["name"] == "add"
        tool = await client.step(started.session, add_call(7, 8))
        assert tool.messages == [Message("tool", "15", tool_call_id="call_0")]
        assert tool.observation == "15"
        return await client.step(started.session, "<answer>15</answer>")

    final = asyncio.run(main())
    assert final.done and final.reward == 1.0


def test_images_in_prompts_and_responses_reach_the_model_as_png_parts():
    env = make_env("verifiers:tests.unit.test_env_verifiers:load_screens")
    (opening,), _ = env.reset("0", seed=0)
    (red,) = opening.images()  # the JPEG, re-encoded as PNG
    assert opening.text() == "Which color?\n<image>" and png_size(red) == (16, 8)
    assert Image.open(io.BytesIO(red)).getpixel((3, 3))[0] > 200
    step = env.step("<answer>red</answer>")
    assert [m.images() for m in step.observation] == [[base64.b64decode(BLUE_PNG[22:])]]
    prompt = env.vf.seen[0]["content"]  # what the environment is handed keeps the image parts
    assert [part["type"] for part in prompt] == ["text", "image_url"]
    assert prompt[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert env.step("<answer>blue</answer>").reward == 1.0


def test_a_remote_image_url_is_a_one_line_error():
    env = make_env("verifiers:tests.unit.test_env_verifiers:load_screens",
                   options={"url": "https://example.com/a.png"})
    with pytest.raises(ImageError, match="expected an image data URL"):
        env.reset("0", seed=0)
