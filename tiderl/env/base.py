"""The environment contract: one episode's state, text in and text out, and the registry.

An :class:`Environment` holds one episode. ``reset(task, seed)`` starts it and returns the first
observation; ``step(action)`` answers one action with a :class:`StepResult`. The same
``(task, seed)`` always gives the same episode. Every environment ends an episode at
``max_turns`` steps (``done`` with the reward the episode earned so far, usually 0).

:func:`make_env` builds one by name: a built-in (:data:`ENV_NAMES`), ``gym:ENV_ID`` or
``gym:module:factory`` (a gymnasium env with text observations and actions, see
:mod:`tiderl.env.gym_adapter`), or a dotted path ``package.module:ClassName`` /
``package.module.ClassName`` naming a subclass of :class:`Environment`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

ENV_NAMES: tuple[str, ...] = ("guess", "shop", "household")

_BUILTIN_PATHS = {
    "guess": "tiderl.env.guess:GuessEnv",
    "shop": "tiderl.env.shop:ShopEnv",
    "household": "tiderl.env.household:HouseholdEnv",
}


class UnknownEnvironment(ValueError):
    """A name :func:`make_env` cannot resolve to an environment."""


@dataclass(frozen=True, slots=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]  # JSON-serialisable only


class Environment(ABC):
    """One episode's state. Text in, text out. Deterministic for (task, seed)."""

    name: ClassVar[str] = ""

    def __init__(self, max_turns: int = 20):
        if max_turns < 1:
            raise ValueError(f"max_turns: expected a positive integer, got {max_turns!r}")
        self.max_turns = max_turns

    @abstractmethod
    def reset(self, task: str | None, seed: int) -> tuple[str, dict[str, Any]]:
        """Start an episode; return the first observation and an info dict."""

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
    path = _BUILTIN_PATHS.get(name)
    if path is None and "." not in name and ":" not in name:
        raise UnknownEnvironment(
            f"unknown environment {name!r}; expected one of {', '.join(ENV_NAMES)}, "
            "gym:ENV_ID, gym:module:factory or a dotted path to an Environment subclass")
    cls = _load_object(path or name)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UnknownEnvironment(f"{name!r} is not a subclass of tiderl.env.base.Environment")
    try:
        return cls(max_turns=max_turns, **(options or {}))
    except TypeError as exc:  # an option the environment does not have
        raise UnknownEnvironment(f"{name}: bad options {options}: {exc}") from None
