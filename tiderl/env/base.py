"""The environment contract: one episode's state, text in and text (or messages) out.

An :class:`Environment` holds one episode. ``reset(task, seed)`` starts it and returns the first
observation; ``step(action)`` answers one action with a :class:`StepResult`. The same
``(task, seed)`` always gives the same episode. Every environment ends an episode at
``max_turns`` steps (``done`` with the reward the episode earned so far, usually 0).

An observation (:data:`Observation`) is either plain text or a list of OpenAI-style
:class:`~tiderl.env.protocol.Message` s:

    plain text   "higher . 17 turns left ."     -> on the wire: one user message, and the text
    messages     [Message("system", ...),        -> on the wire: these messages, and their
                  Message("user", ...)]             contents joined (:func:`observation_text`)
                 [Message("tool", "391", tool_call_id="call_0", name="calculator")]
                 [Message("user", [image_part(png),      -> text: "<image>\nClick ..."
                                   TextPart("Click ...")])]

A plain-text environment (guess, shop, household, the gymnasium adapter on text observations)
returns strings and needs nothing else. A chat environment returns messages: a system and a
user message from ``reset``, tool results (role ``tool``) and/or user text from ``step``; it
declares the tools the model may call as OpenAI schemas in :attr:`Environment.tools` (sent with
``/start``). A message's content may be text and PNG image parts (:mod:`tiderl.env.protocol`;
the gui environment, the gymnasium adapter on image observations). The action is always the
model's raw text: an environment parses tool calls out of it with
:func:`tiderl.env.tools.parse_tool_calls`; :class:`tiderl.env.tools.ToolEnvironment` does all
of that for tools that are Python callables.

:func:`tiderl.env.registry.make_env` builds one by name. This module imports no environment:
the built-ins and the adapters import it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from tiderl.core.quote import short
from tiderl.env.protocol import Message, messages_text

Observation: TypeAlias = str | list[Message]


class UnknownEnvironment(ValueError):
    """A name :func:`tiderl.env.registry.make_env` cannot resolve to an environment."""


@dataclass(frozen=True, slots=True)
class StepResult:
    observation: Observation  # text, or the messages that follow the action
    reward: float
    done: bool
    info: dict[str, Any]  # JSON-serialisable only


def observation_messages(observation: Observation) -> list[Message]:
    """The messages form of an observation: plain text is one user message."""
    if isinstance(observation, str):
        return [Message(role="user", content=observation)]
    for message in observation:
        if not isinstance(message, Message):
            raise TypeError(f"an observation is text or a list of Message, not a list holding "
                            f"{type(message).__name__}")
    return list(observation)


def observation_text(observation: Observation) -> str:
    """The plain-text form of an observation: the text itself, or the messages' contents
    joined by newlines."""
    return observation if isinstance(observation, str) else messages_text(observation)


class Environment(ABC):
    """One episode's state. Text in; text or messages out. Deterministic for (task, seed).

    ``tools``: the OpenAI tool schemas the model may call (none for a plain-text environment);
    ``is_word_level``: every observation fits the word-level vocabulary
    (:mod:`tiderl.models.vocab`); False for an environment meant for a byte-level tokenizer."""

    name: ClassVar[str] = ""
    is_word_level: ClassVar[bool] = True

    @property
    def tools(self) -> list[dict[str, Any]]:
        return []

    def __init__(self, max_turns: int = 20):
        if max_turns < 1:
            raise ValueError(f"max_turns: expected a positive integer, got {short(max_turns)}")
        self.max_turns = max_turns

    @abstractmethod
    def reset(self, task: str | None, seed: int) -> tuple[Observation, dict[str, Any]]:
        """Start an episode; return the first observation (text or messages) and an info
        dict."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Answer one action; at the turn cap the result is ``done``."""

    def solve(self) -> str:
        """The scripted solver's next action for the current state (used by tests and demos)."""
        raise NotImplementedError(f"{type(self).__name__} has no scripted solver")

