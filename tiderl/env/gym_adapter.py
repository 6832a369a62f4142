"""Serve a gymnasium env whose observations and actions are text as a TideRL :class:`Environment`.

``make_env("gym:ENV_ID")`` builds a registered gymnasium id with ``gymnasium.make``;
``make_env("gym:package.module:factory")`` calls ``factory()`` (no arguments), which returns a
``gymnasium.Env``. The adapter maps:

    reset(task, seed) → env.reset(seed=seed, options={"task": task} if task else None)
    step(action)      → env.step(action)          (the action string, unchanged)
    observation       → str(observation)          (a ``gymnasium.spaces.Text`` space, ideally)
    reward, terminated or truncated → StepResult.reward, StepResult.done

and ends the episode itself at ``max_turns`` steps (``info["truncated"] = True``). Info values
that are not JSON types are dropped (StepResult.info crosses the wire). gymnasium is optional:
without it, ``make_env("gym:...")`` raises :class:`GymUnavailable` naming the install.
"""

from __future__ import annotations

import importlib
from typing import Any

from tiderl.env.base import Environment, StepResult, UnknownEnvironment

_JSON_SCALARS = (str, int, float, bool, type(None))


class GymUnavailable(UnknownEnvironment):
    """``gym:`` environments need gymnasium, which is not installed."""


def _json_info(info: dict[str, Any]) -> dict[str, Any]:
    """The JSON-serialisable part of a gymnasium info dict (scalars and lists of scalars)."""
    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, _JSON_SCALARS) or (
                isinstance(value, list | tuple) and all(isinstance(v, _JSON_SCALARS)
                                                        for v in value)):
            out[str(key)] = list(value) if isinstance(value, tuple) else value
    return out


def _import_gymnasium() -> Any:
    try:
        return importlib.import_module("gymnasium")
    except ImportError as exc:
        raise GymUnavailable("gym: environments need gymnasium; install it with "
                             "`pip install gymnasium`") from exc


class GymEnv(Environment):
    """One gymnasium env, text in and text out."""

    name = "gym"

    def __init__(self, env: Any, max_turns: int = 20):
        super().__init__(max_turns)
        self.env = env
        self.turns = 0
        self.done = True

    def reset(self, task: str | None, seed: int) -> tuple[str, dict[str, Any]]:
        observation, info = self.env.reset(seed=seed, options={"task": task} if task else None)
        self.turns, self.done = 0, False
        return str(observation), _json_info(info)

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult("the episode is over .", 0.0, True, {"turns": self.turns})
        self.turns += 1
        observation, reward, terminated, truncated, info = self.env.step(action)
        out = _json_info(info)
        if not terminated and self.turns >= self.max_turns:
            truncated = True
        out.update(turns=self.turns, terminated=bool(terminated), truncated=bool(truncated))
        self.done = bool(terminated or truncated)
        return StepResult(str(observation), float(reward), self.done, out)


def make_gym_env(spec: str, *, max_turns: int = 20) -> GymEnv:
    """``ENV_ID`` (registered) or ``module:factory`` → a :class:`GymEnv`."""
    gymnasium = _import_gymnasium()
    if ":" in spec and not spec.startswith(":"):
        module_name, _, attr = spec.rpartition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise UnknownEnvironment(f"gym:{spec}: cannot import {attr!r} from "
                                     f"{module_name!r}: {exc}") from exc
        env = factory()
    else:
        try:
            env = gymnasium.make(spec, disable_env_checker=True)
        except gymnasium.error.Error as exc:
            raise UnknownEnvironment(f"gym:{spec}: {exc}") from exc
    if not isinstance(env, gymnasium.Env):
        raise UnknownEnvironment(f"gym:{spec} did not build a gymnasium.Env")
    return GymEnv(env, max_turns=max_turns)
