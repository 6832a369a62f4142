"""Tool calls in the model's text, and an environment whose tools are Python callables.

The model's action is raw text. Qwen-family chat templates (the Hermes / Qwen2.5 format) have
the model write each call as JSON between tags, any number of them, around free text:

    I need the product first.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17 * 23"}}
    </tool_call>

:func:`parse_tool_calls` reads them into OpenAI-style :class:`ToolCall` s, ids ``call_0``,
``call_1``, ... by position, so the environment and the rollout side derive the same ids from
the same text. It never raises: a call whose JSON is malformed (or that names no function)
becomes a call with an empty name that keeps its text as ``arguments``, and :func:`run_tool_call`
answers it with a tool message saying so, as it answers unknown tools, arguments that are not a
JSON object and callables that raise.

:class:`ToolEnvironment` is the OpenAI tool loop as an :class:`Environment`:

    reset(task, seed) ──make_task──> [system prompt], user prompt        (+ tools: the schemas)
    step(text) ──> a final answer?  ──yes──> score(answer, task) ──> done, reward
                   tool calls?      ──yes──> run each callable ──> tool messages
                   neither          ────────> a user message asking for one
               the turn cap without a final answer: done, reward 0 (``info["truncated"]``)

A subclass brings OpenAI tool schemas (``tool_schemas``), one callable per schema
(``tool_functions``), a task source (``make_task``) and a scoring function (``score``); see
:mod:`tiderl.env.calc` for a complete one.
"""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tiderl.core.quote import short
from tiderl.env.base import Environment, StepResult
from tiderl.env.protocol import Message, ToolCall, ToolFunction

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)
MAX_TOOL_CALLS = 8  # per action: the rest are answered with an error, not run
MAX_TOOL_OUTPUT_CHARS = 4096


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, in order
    (an unclosed last one included); a malformed one is a call with an empty name whose
    ``arguments`` is its text. Never raises."""
    return [_parse_call(body.strip(), f"call_{i}") for i, body in enumerate(_CALL.findall(text))]


def _parse_call(body: str, call_id: str) -> ToolCall:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        call = None
    name = call.get("name") if isinstance(call, dict) else None
    if not isinstance(name, str) or not name:
        return ToolCall(call_id, ToolFunction("", body))
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):  # a JSON string is already the arguments' text
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call_id, ToolFunction(name, arguments))


def answer_message(text: str, id_prefix: str = "call_") -> Message:
    """The model's raw text as an API answer: each well-formed call a ``tool_calls`` entry (ids
    ``{id_prefix}0``, ...), the text around them the content; a malformed call stays in the
    content as the text the model wrote, never an error."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _CALL.finditer(text):
        call = _parse_call(match.group(1).strip(), f"{id_prefix}{len(calls)}")
        if call.function.name:
            kept.append(text[at:match.start()])
            at = match.end()
            calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return Message(role="assistant", content=content, tool_calls=calls or None)


def assistant_message(text: str) -> Message:
    """The model's raw text as an assistant message: the text around the tool calls as
    content, the calls as ``tool_calls`` (None without any)."""
    calls = parse_tool_calls(text)
    content = _CALL.sub("", text).strip() if calls else text
    return Message(role="assistant", content=content, tool_calls=calls or None)


def run_tool_call(call: ToolCall, functions: dict[str, Callable[..., Any]]) -> Message:
    """Run one call; the answer is always a tool message (errors included)."""
    name = call.function.name
    return Message(role="tool", content=_tool_output(call, functions)[:MAX_TOOL_OUTPUT_CHARS],
                   tool_call_id=call.id, name=name or None)


def _tool_output(call: ToolCall, functions: dict[str, Callable[..., Any]]) -> str:
    name = call.function.name
    if not name:
        return ('error: malformed tool call: expected <tool_call>{"name": "...", '
                '"arguments": {...}}</tool_call> with valid JSON')
    if name not in functions:
        return f"error: unknown tool {short(name)}; the tools are {', '.join(sorted(functions))}"
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        return f"error: the arguments of {name} are not a JSON object"
    try:
        result = functions[name](**arguments)
    except Exception as exc:  # the model's call failed: it reads why, the episode goes on
        return f"error: {name} failed: {type(exc).__name__}: {exc}"
    return result if isinstance(result, str) else json.dumps(result, default=str)


@dataclass(frozen=True)
class ToolTask:
    """One task of a :class:`ToolEnvironment`: the user's prompt, the reference answer the
    scoring function reads, and info sent with /start (JSON types only)."""

    prompt: str
    answer: str
    info: dict[str, Any] = field(default_factory=dict)


class ToolEnvironment(Environment):
    """The OpenAI tool loop (see the module docstring). Subclasses set ``tool_schemas`` and
    implement ``tool_functions``, ``make_task`` and ``score``.

    ``answer_tag``: the final answer is the text inside ``<answer>...</answer>`` (any text
    without it or a tool call costs a turn and is told so); None: any reply without a tool
    call is the final answer (the OpenAI convention)."""

    is_word_level: ClassVar[bool] = False
    tool_schemas: ClassVar[tuple[dict[str, Any], ...]] = ()
    system_prompt: ClassVar[str] = ""
    answer_tag: ClassVar[str | None] = "answer"

    def __init__(self, max_turns: int = 20):
        super().__init__(max_turns)
        self.functions = self.tool_functions()
        names = [schema["function"]["name"] for schema in self.tool_schemas]
        if sorted(names) != sorted(self.functions):
            raise ValueError(f"{type(self).__name__}: tool schemas {sorted(names)} and tool "
                             f"functions {sorted(self.functions)} differ")
        self.task = ToolTask("", "")
        self.turns = self.num_tool_calls = 0
        self.done = True
        self.tool_results: list[Message] = []  # this episode's tool messages, in order

    @property
    def tools(self) -> list[dict[str, Any]]:
        return list(self.tool_schemas)

    @abstractmethod
    def tool_functions(self) -> dict[str, Callable[..., Any]]:
        """The callable of each tool, by the name its schema gives."""

    @abstractmethod
    def make_task(self, task: str | None, seed: int) -> ToolTask:
        """The episode's task; the same for the same (task, seed)."""

    @abstractmethod
    def score(self, answer: str, task: ToolTask) -> float:
        """The reward of a final answer, in [0, 1]."""

    def final_answer(self, text: str) -> str | None:
        """The final answer in the model's text, or None if it has none."""
        if self.answer_tag is None:
            return None if parse_tool_calls(text) else text.strip()
        match = re.search(rf"<{self.answer_tag}>(.*?)</{self.answer_tag}>", text, re.DOTALL)
        return match.group(1).strip() if match else None

    def reset(self, task: str | None, seed: int) -> tuple[list[Message], dict[str, Any]]:
        self.task = self.make_task(task, seed)
        self.turns = self.num_tool_calls = 0
        self.done = False
        self.tool_results = []
        opening = [Message(role="system", content=self.system_prompt)] if self.system_prompt \
            else []
        return [*opening, Message(role="user", content=self.task.prompt)], dict(self.task.info)

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult([Message(role="user", content="the episode is over.")], 0.0, True,
                              self._info())
        self.turns += 1
        answer = self.final_answer(action)
        if answer is not None:
            self.done = True
            reward = float(self.score(answer, self.task))
            return StepResult([Message(role="user", content=f"Your answer: {answer}.")], reward,
                              True, self._info(answer=answer))
        messages = self._run_calls(parse_tool_calls(action)) or [self._no_call_message()]
        if self.turns >= self.max_turns:
            self.done = True
            return StepResult(messages, 0.0, True, self._info(truncated=True))
        return StepResult(messages, 0.0, False, self._info())

    def _run_calls(self, calls: list[ToolCall]) -> list[Message]:
        messages = []
        for i, call in enumerate(calls):
            if i >= MAX_TOOL_CALLS:
                messages.append(Message(role="tool", tool_call_id=call.id,
                                        name=call.function.name or None,
                                        content=f"error: at most {MAX_TOOL_CALLS} tool calls "
                                                "per turn; this one was not run"))
                continue
            messages.append(run_tool_call(call, self.functions))
            self.num_tool_calls += 1
        self.tool_results += messages
        return messages

    def _no_call_message(self) -> Message:
        tag = self.answer_tag
        return Message(role="user", content=f"No tool call and no <{tag}>...</{tag}> found: "
                                            f"call a tool or give the final answer.")

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.num_tool_calls, **extra}
