"""Play a verifiers environment (prime-rl's environment library) through the step protocol.

``make_env("verifiers:ENV_ID")`` imports the installed environment module ``ENV_ID`` (dashes
read as underscores, an ``owner/`` prefix dropped) and calls its ``load_environment(**options)``,
as ``verifiers.load_environment`` does; ``make_env("verifiers:package.module:factory")`` calls
``factory(**options)``. ``options`` are the profile's ``env.options`` for that name (the
environment's arguments).

What is adapted is verifiers' classic multi-turn interface (``MultiTurnEnv``, ``SingleTurnEnv``,
``ToolEnv``; verifiers 0.1.x, and ``verifiers.legacy`` in 0.2 and 0.3), read by duck typing:

    reset(task, seed) → a dataset row (``env.get_dataset()``; task ``"eval"``: the eval set;
                        task ``"N"`` / ``"eval N"``: row N; else row ``seed % len``) → its
                        ``prompt`` messages (built from ``question`` with ``env.system_prompt``
                        and ``env.few_shot`` when the row has none); ``env.setup_state(state)``
    step(action)      → append the assistant message (tool calls parsed out of the text,
                        :func:`tiderl.env.tools.parse_tool_calls`); ``env.is_completed``; if not
                        completed, ``env.env_response(messages, state)`` → the observation
    done              → ``env.rubric.score_rollout`` → the reward (rubric metrics in ``info``)

Both generations of the classic signatures are handled: ``is_completed(messages, state)`` /
``is_completed(state)`` (stop conditions), ``env_response`` returning ``(messages, state)`` /
messages (dicts or message objects), ``score_rollout(prompt, completion, answer, state, task,
info)`` returning a score / ``score_rollout(state)`` setting ``state["reward"]``. Messages are
handed to the environment as OpenAI-format dicts whose keys also read as attributes
(``m["role"]`` and ``m.role``; a tool call's ``tc.name``/``tc.arguments`` and
``tc["function"]``), so code of either generation reads them. The episode also ends at the
environment's own ``max_turns`` (``SingleTurnEnv``: one turn) and at ``max_turns`` here
(``info["truncated"]``); the rubric scores the episode either way. Images in a message's
content parts (``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}``, in
prompts and environment responses) are kept, each re-encoded as PNG where it is another format
(JPEG, WebP: what Pillow reads), and reach the model as the protocol's image parts; a remote
URL is a one-line error (nothing is fetched).

Not adapted: verifiers 0.4's ``verifiers.v1`` stack (``Taskset``/``Harness``/``Env``), where
the environment runs the model itself through an OpenAI endpoint; it has no step interface.
verifiers is not a dependency: 0.4.0, the current release, installs about 130 MB of packages
(no torch) and no longer ships the classic interface, so the contract test
(``tests/unit/test_env_verifiers.py``) plays stand-ins written to the classic signatures.

verifiers' methods are coroutines: each loaded environment gets one event loop of its own that
runs them to completion on each call (in a helper thread when the caller's thread already runs
a loop, as the service's does), so a step blocks like any environment's step.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import importlib
import inspect
import io
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tiderl.core.quote import short
from tiderl.env.base import Environment, StepResult, UnknownEnvironment
from tiderl.env.images import PNG_DATA_URL_PREFIX, ImageError, png_data_url
from tiderl.env.protocol import ContentPart, Message
from tiderl.env.tools import assistant_message


class _Record(dict):
    """A message or tool call for verifiers code: a dict whose keys read as attributes too
    (a missing key reads as None, as on verifiers' message objects)."""

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return self.get(key)


@dataclass
class LoadedEnv:
    """One verifiers environment, shared by every episode of its name (verifiers runs many
    rollouts on one environment object, each with its own state), and its event loop."""

    env: Any
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    datasets: dict[str, Any] = field(default_factory=dict)

    def run(self, value: Any) -> Any:
        """``value``, or the result of awaiting it on this environment's loop."""
        if not inspect.isawaitable(value):
            return value
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self.loop.run_until_complete(value)
        with ThreadPoolExecutor(1) as pool:  # this thread runs a loop: finish it elsewhere
            return pool.submit(self.loop.run_until_complete, value).result()

    def dataset(self, split: str) -> Any:
        if split not in self.datasets:
            getter = getattr(self.env, "get_eval_dataset" if split == "eval" else "get_dataset",
                             None)
            data = getter() if getter else getattr(self.env, f"{split}_dataset"
                                                   if split == "eval" else "dataset", None)
            if data is None or len(data) == 0:
                raise ValueError(f"the environment has no {split} dataset")
            self.datasets[split] = data
        return self.datasets[split]


LOADED_ENVS = 16  # (spec, options) pairs a service keeps loaded


def load(spec: str, options: dict[str, Any] | None) -> LoadedEnv:
    """The environment ``spec`` with ``options``, loaded once: loading one reads its dataset
    (seconds), and each /start makes an environment."""
    return _load(spec, json.dumps(options or {}, sort_keys=True, default=str))


@functools.lru_cache(maxsize=LOADED_ENVS)
def _load(spec: str, options_json: str) -> LoadedEnv:
    return LoadedEnv(_build(spec, json.loads(options_json)))


def _build(spec: str, options: dict[str, Any]) -> Any:
    if ":" in spec:
        module_name, _, attr = spec.rpartition(":")
    else:
        module_name, attr = spec.replace("-", "_").split("/")[-1], "load_environment"
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownEnvironment(f"verifiers:{spec}: cannot import {attr!r} from "
                                 f"{module_name!r}: {exc}") from exc
    try:
        env = factory(**options)
    except TypeError as exc:
        raise UnknownEnvironment(f"verifiers:{spec}: bad options {options}: {exc}") from None
    missing = [a for a in ("env_response", "is_completed", "rubric") if not hasattr(env, a)]
    if missing:
        raise UnknownEnvironment(
            f"verifiers:{spec}: not a classic verifiers environment (MultiTurnEnv, "
            f"SingleTurnEnv or ToolEnv): no {', '.join(missing)}; verifiers 0.4's v1 Env is "
            "not supported")
    return env


def make_verifiers_env(spec: str, *, max_turns: int = 20,
                       options: dict[str, Any] | None = None) -> VerifiersEnv:
    """``ENV_ID`` or ``module:factory`` → a :class:`VerifiersEnv` (no episode yet)."""
    return VerifiersEnv(load(spec, options), max_turns=max_turns)


class VerifiersEnv(Environment):
    """One episode of a verifiers environment (see the module docstring)."""

    name = "verifiers"
    is_word_level = False

    def __init__(self, loaded: LoadedEnv, max_turns: int = 20):
        super().__init__(max_turns)
        self.loaded = loaded
        self.vf = loaded.env
        self.messages: list[_Record] = []
        self.state: dict[str, Any] = {}
        self.turns = 0
        self.done = True

    @property
    def tools(self) -> list[dict[str, Any]]:
        info = self.state.get("info")
        schemas = (info.get("oai_tools") if isinstance(info, dict) else None) \
            or getattr(self.vf, "oai_tools", None) or getattr(self.vf, "tool_defs", None) or []
        return [_openai_tool(schema) for schema in schemas]

    def reset(self, task: str | None, seed: int) -> tuple[list[Message], dict[str, Any]]:
        split, index = _row_choice(task)
        dataset = self.loaded.dataset(split)
        row_index = (index if index is not None else seed) % len(dataset)
        row = dict(dataset[row_index])
        prompt = [_record(m) for m in self._prompt(row)]
        info = row.get("info") or {}
        self.state = {
            "prompt": prompt, "completion": [], "answer": row.get("answer", ""),
            "task": row.get("task", "default"), "info": json.loads(info) if isinstance(info, str)
            else info, "example_id": row_index, "responses": [], "turn": 0, "trajectory": [],
            "is_completed": False, "is_truncated": False, "error": None,
            "final_env_response": None, "reward": None, "metrics": None,
        }
        setup = getattr(self.vf, "setup_state", None)
        if setup is not None:
            self.state = self.loaded.run(setup(self.state)) or self.state
        self.messages = list(prompt)
        self.turns, self.done = 0, False
        return [_message(m) for m in prompt], {"split": split, "row": row_index}

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult("the episode is over.", 0.0, True, {"turns": self.turns})
        self.turns += 1
        reply = _record(msgspec.to_builtins(assistant_message(action)))
        self.state["trajectory"].append({"prompt": list(self.messages), "completion": [reply]})
        self._append([reply])
        self.state["turn"] = self.turns
        observation: list[_Record] = []
        done = self._is_completed()
        if not done:
            observation = self._env_response()
            done = self.state.get("final_env_response") is not None
        truncated = not done and self.turns >= self.max_turns
        if not (done or truncated):
            return StepResult([_message(m) for m in observation], 0.0, False,
                              {"turns": self.turns})
        self.done = True
        reward, metrics = self._score()
        info = {"turns": self.turns, "truncated": truncated, "metrics": metrics}
        return StepResult([_message(m) for m in observation], reward, True, info)

    def _prompt(self, row: dict[str, Any]) -> list[Any]:
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if prompt:
            return list(prompt)
        if "question" not in row:
            raise ValueError("the dataset row has neither a prompt nor a question")
        system = getattr(self.vf, "system_prompt", None)
        return [*([{"role": "system", "content": system}] if system else []),
                *(getattr(self.vf, "few_shot", None) or []),
                {"role": "user", "content": row["question"]}]

    def _append(self, messages: list[_Record]) -> None:
        self.messages += messages
        self.state["completion"] += messages

    def _is_completed(self) -> bool:
        own_cap = getattr(self.vf, "max_turns", -1)
        if isinstance(own_cap, int) and 0 < own_cap <= self.turns:
            return True
        check = self.vf.is_completed
        args = (self.messages, self.state) if "messages" in _params(check) else (self.state,)
        return bool(self.loaded.run(check(*args)))

    def _env_response(self) -> list[_Record]:
        out = self.loaded.run(self.vf.env_response(self.messages, self.state))
        if isinstance(out, tuple):  # the older (messages, state)
            out, self.state = out
        final = self.state.get("final_env_response")
        messages = [_record(m) for m in (final if final is not None else out) or []]
        self._append(messages)
        return messages

    def _score(self) -> tuple[float, dict[str, float]]:
        rubric, state = self.vf.rubric, self.state
        if "prompt" in _params(rubric.score_rollout):  # the older signature returns the score
            score = self.loaded.run(rubric.score_rollout(
                state["prompt"], state["completion"], state["answer"], state, state["task"],
                state["info"]))
            reward = score["reward"] if isinstance(score, dict) else score.reward
            metrics = score.get("metrics") if isinstance(score, dict) else \
                getattr(score, "metrics", None)
        else:
            self.loaded.run(rubric.score_rollout(state))
            reward, metrics = state.get("reward"), state.get("metrics")
        return float(reward or 0.0), {str(k): float(v) for k, v in (metrics or {}).items()
                                      if isinstance(v, int | float)}


def _row_choice(task: str | None) -> tuple[str, int | None]:
    """``None``/``""``: train, by seed; ``"N"``: train row N; ``"eval"``, ``"eval N"``."""
    words = (task or "").split()
    split = "eval" if words[:1] == ["eval"] else "train"
    rest = words[1:] if split == "eval" else words
    if not rest:
        return split, None
    if len(rest) == 1 and rest[0].isdigit():
        return split, int(rest[0])
    raise ValueError(f"task: expected empty, N, 'eval' or 'eval N', got {short(task)}")


def _params(method: Any) -> set[str]:
    try:
        return set(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return set()


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _content(content: Any) -> str | list[dict[str, Any]]:
    """A message's content: a string, or the text of its content parts; parts that hold an
    image stay parts (OpenAI shape), each image a PNG data URL."""
    if content is None or isinstance(content, str):
        return content or ""
    if not any(_get(part, "type") == "image_url" for part in content):
        return "".join(_get(part, "text") or "" for part in content)
    return [{"type": "image_url", "image_url": {"url": _png_url(_get(_get(p, "image_url"), "url"))}}
            if _get(p, "type") == "image_url" else {"type": "text", "text": _get(p, "text") or ""}
            for p in content]


def _png_url(url: Any) -> str:
    """An image data URL as a PNG one (decoded and re-encoded where it is another format)."""
    if not isinstance(url, str) or not url.startswith("data:image/"):
        raise ImageError(f"image_url: expected an image data URL (nothing is fetched), got "
                         f"{str(url)[:40]!r}")
    if url.startswith(PNG_DATA_URL_PREFIX):
        return url
    head, _, data = url.partition(",")
    if not head.endswith(";base64"):
        raise ImageError(f"image_url: expected base64 data, got {head[:40]!r}")
    from PIL import Image, UnidentifiedImageError  # Pillow: a dependency of matplotlib

    try:
        picture = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        out = io.BytesIO()
        picture.convert("RGBA" if "A" in picture.getbands() else "RGB").save(out, format="PNG")
    except (binascii.Error, ValueError, OSError, UnidentifiedImageError) as exc:
        raise ImageError(f"image_url: {head[5:]} does not decode: {exc}") from None
    return png_data_url(out.getvalue())


def _record(message: Any) -> _Record:
    """Any message (dict or object, OpenAI or verifiers tool-call shape) as a :class:`_Record`
    in OpenAI shape, with verifiers' flat ``name``/``arguments`` on each tool call."""
    out = _Record(role=_get(message, "role"), content=_content(_get(message, "content")))
    calls = []
    for call in _get(message, "tool_calls") or []:
        function = _get(call, "function")
        name = _get(function, "name") if function is not None else _get(call, "name")
        arguments = _get(function, "arguments") if function is not None \
            else _get(call, "arguments")
        calls.append(_Record(id=_get(call, "id"), type="function", name=name,
                             arguments=arguments,
                             function=_Record(name=name, arguments=arguments)))
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if _get(message, key) is not None:
            out[key] = _get(message, key)
    return out


def _message(record: _Record) -> Message:
    """A :class:`_Record` as a protocol :class:`Message` (ValueError for a role it lacks)."""
    is_tool = record["role"] == "tool"
    content = record["content"]
    if not isinstance(content, str):
        content = msgspec.convert(content, list[ContentPart])
    return Message(role=record["role"], content=content,
                   tool_call_id=record.get("tool_call_id") if is_tool else None,
                   name=record.get("name") if is_tool else None)


def _openai_tool(schema: Any) -> dict[str, Any]:
    """An OpenAI tool schema from either shape verifiers uses (``{"type": "function",
    "function": {...}}`` or a flat ``{name, description, parameters}`` / ``vf.Tool``)."""
    if isinstance(schema, dict) and schema.get("type") == "function" and "function" in schema:
        return schema
    return {"type": "function", "function": {
        "name": _get(schema, "name"), "description": _get(schema, "description") or "",
        "parameters": _get(schema, "parameters") or {"type": "object", "properties": {}}}}
