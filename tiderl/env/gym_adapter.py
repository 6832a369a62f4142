"""Serve a gymnasium env whose actions are text as a TideRL :class:`Environment`.

``make_env("gym:ENV_ID")`` builds a registered gymnasium id with ``gymnasium.make``;
``make_env("gym:package.module:factory")`` calls ``factory()`` (no arguments), which returns a
``gymnasium.Env``. The adapter maps:

    reset(task, seed) → env.reset(seed=seed, options={"task": task} if task else None)
    step(action)      → env.step(action)          (the action string, unchanged)
    observation       → str(observation)          (a ``gymnasium.spaces.Text`` space, ideally)
                      or an image message          (see below)
    reward, terminated or truncated → StepResult.reward, StepResult.done

and ends the episode itself at ``max_turns`` steps (``info["truncated"] = True``). Info values
that are not JSON types are dropped (StepResult.info crosses the wire). gymnasium is optional:
without it, ``make_env("gym:...")`` raises :class:`GymUnavailable` naming the install.

Image observations become one user message, the image (a PNG part) before the text:

    uint8 array H x W x 3 (a ``Box(0, 255, (H, W, 3), uint8)``)  → [image]
    dict with "image" or "pixels" (uint8 H x W x 3),             → [image, text]
         and "text" or "mission" (the text, if any; other keys are dropped)

Any other observation (a dict without an image key, a float array) is ``str(observation)`` as
before. An image key holding anything but a uint8 H x W x 3 array, or an image over the limits
of :mod:`tiderl.env.images`, is an :class:`~tiderl.env.images.ImageError` (the service answers
422).
"""

from __future__ import annotations

import importlib
import io
from typing import Any

import numpy as np  # gymnasium's own dependency (and matplotlib's)
from PIL import Image

from tiderl.env.base import Environment, Observation, StepResult, UnknownEnvironment
from tiderl.env.images import MAX_IMAGE_PIXELS, ImageError
from tiderl.env.protocol import ContentPart, ImagePart, Message, TextPart, image_part

_JSON_SCALARS = (str, int, float, bool, type(None))
IMAGE_KEYS = ("image", "pixels")
TEXT_KEYS = ("text", "mission")


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


def _is_rgb_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3 \
        and value.shape[2] == 3 and value.size > 0


def _image_part(array: np.ndarray) -> ImagePart:
    """The PNG part of an H x W x 3 array, its size checked before it is encoded."""
    height, width = array.shape[:2]
    if height * width > MAX_IMAGE_PIXELS:
        raise ImageError(f"image: {width}x{height} = {width * height} pixels, more than the "
                         f"limit ({MAX_IMAGE_PIXELS})")
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(out, format="PNG")
    return image_part(out.getvalue())


def gym_observation(observation: Any) -> Observation:
    """A gymnasium observation as text or as one user message with its image (see the module
    docstring)."""
    if _is_rgb_array(observation):
        return [Message(role="user", content=[_image_part(observation)])]
    if not isinstance(observation, dict):
        return str(observation)
    image_key = next((key for key in IMAGE_KEYS if key in observation), None)
    if image_key is None:
        return str(observation)
    image = observation[image_key]
    if not _is_rgb_array(image):
        raise ImageError(f"gym: observation[{image_key!r}]: expected a uint8 array of shape "
                         f"(H, W, 3), got {type(image).__name__} "
                         f"{getattr(image, 'dtype', '')} {getattr(image, 'shape', '')}")
    parts: list[ContentPart] = [_image_part(image)]
    text = next((observation[key] for key in TEXT_KEYS if key in observation), None)
    if text is not None and str(text):
        parts.append(TextPart(str(text)))
    return [Message(role="user", content=parts)]


class GymEnv(Environment):
    """One gymnasium env, text in; text, or an image message, out."""

    name = "gym"

    def __init__(self, env: Any, max_turns: int = 20):
        super().__init__(max_turns)
        self.env = env
        self.turns = 0
        self.done = True

    def reset(self, task: str | None, seed: int) -> tuple[Observation, dict[str, Any]]:
        observation, info = self.env.reset(seed=seed, options={"task": task} if task else None)
        self.turns, self.done = 0, False
        return gym_observation(observation), _json_info(info)

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
        return StepResult(gym_observation(observation), float(reward), self.done, out)


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
