"""The environment contract: one episode's state, text in and text (or messages) out, and the
registry.

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

:func:`make_env` builds one by name: a built-in (:data:`ENV_NAMES`), ``gym:ENV_ID`` or
``gym:module:factory`` (a gymnasium env with text actions, see
:mod:`tiderl.env.gym_adapter`), ``verifiers:ENV_ID`` or ``verifiers:module:factory`` (a
verifiers multi-turn environment, see :mod:`tiderl.env.verifiers_adapter`), or a dotted path
``package.module:ClassName`` / ``package.module.ClassName`` naming a subclass of
:class:`Environment` (such as a :class:`tiderl.env.tools.ToolEnvironment`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from tiderl.env.protocol import Message, messages_text

Observation: TypeAlias = str | list[Message]

ENV_NAMES: tuple[str, ...] = ("guess", "shop", "household", "calc", "gui")

_BUILTIN_PATHS = {
    "guess": "tiderl.env.guess:GuessEnv",
    "shop": "tiderl.env.shop:ShopEnv",
    "household": "tiderl.env.household:HouseholdEnv",
    "calc": "tiderl.env.calc:CalcEnv",
    "gui": "tiderl.env.gui:GuiEnv",
}


class UnknownEnvironment(ValueError):
    """A name :func:`make_env` cannot resolve to an environment."""


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
            raise ValueError(f"max_turns: expected a positive integer, got {max_turns!r}")
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


def _load_object(path: str) -> Any:
    """``package.module:attr`` or ``package.module.attr`` → the object."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise UnknownEnvironment(f"unknown environment {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownEnvironment(f"unknown environment {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise UnknownEnvironment(f"unknown environment {path!r}: no {attr!r} in "
                                 f"{module_name}") from exc


def make_env(name: str, *, max_turns: int = 20, options: dict[str, Any] | None = None
             ) -> Environment:
    """Build a fresh environment (no episode yet) from a registry name or dotted path;
    ``options`` are its constructor's keyword arguments (``env.options`` of a profile)."""
    if name.startswith("gym:"):
        from tiderl.env.gym_adapter import make_gym_env

        if options:
            raise UnknownEnvironment(f"{name}: gymnasium environments take no options")
        return make_gym_env(name[len("gym:"):], max_turns=max_turns)
    if name.startswith("verifiers:"):
        from tiderl.env.verifiers_adapter import make_verifiers_env

        return make_verifiers_env(name[len("verifiers:"):], max_turns=max_turns,
                                  options=options)
    path = _BUILTIN_PATHS.get(name)
    if path is None and "." not in name and ":" not in name:
        raise UnknownEnvironment(
            f"unknown environment {name!r}; expected one of {', '.join(ENV_NAMES)}, "
            "gym:ENV_ID, gym:module:factory, verifiers:ENV_ID, verifiers:module:factory or a "
            "dotted path to an Environment subclass")
    cls = _load_object(path or name)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UnknownEnvironment(f"{name!r} is not a subclass of tiderl.env.base.Environment")
    try:
        return cls(max_turns=max_turns, **(options or {}))
    except TypeError as exc:  # an option the environment does not have
        raise UnknownEnvironment(f"{name}: bad options {options}: {exc}") from None
