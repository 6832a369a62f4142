"""Train a verifiers v1 environment: each TideRL agent task plays one episode of it, as
verifiers plays it for prime-rl.

    env:
      envs: [calc-v1]
      agents:
        calc-v1: {entry: "tiderl.env.verifiers_v1:run"}
      options:
        calc-v1: {taskset: tiderl.examples.calc_v1, max_tokens: 64}

Options: ``taskset`` (required): a verifiers taskset id (an installed environment: ``gsm8k``,
``owner/name``), or a dotted module path (``tiderl.examples.calc_v1``) imported and named by its
last part; ``harness`` (default ``null``: verifiers' chat program with the task's MCP tools);
``tool_parser`` (the renderer's, default ``qwen3``: Hermes-style ``<tool_call>``);
``max_tokens`` (per model call) and ``max_turns`` (model calls per episode).

The harness's program runs in verifiers' subprocess runtime; its model calls go through
verifiers' interception server to verifiers' ``TrainClient``, which renders each turn to token
ids with a ``renderers`` renderer of the job's model folder (bridging from the exact ids of the
turn before where it can) and sends them to the task's endpoint as vLLM's token-in
``/inference/v1/generate``, with the task's key and its own trace id in ``X-Session-ID``. The
episode's reward (its task's reward functions) is the task's. The row played is the TideRL
task's text read as a row number, else its seed modulo the rows.

As an entry (above) the environment is loaded once per environment service and serves every
task's episode (its interception server and shared tool servers stay up, as in a verifiers env
worker). ``python -m tiderl.env.verifiers_v1`` is the same as a command agent (one episode per
process: for verifiers installed in an interpreter of its own), reading the options from
``TIDERL_TASK``. Needs ``pip install tiderl[verifiers]`` (verifiers 0.4, and ``uv``: a harness's
program is a PEP 723 script that verifiers runs with uv, its packages fetched from the package
index the first time).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from typing import Any

OPTIONS = ("taskset", "harness", "tool_parser", "max_tokens", "max_turns")


class EpisodeFailed(Exception):
    """The episode ended without a result: the task fails with this reason."""


def _taskset_id(name: str) -> str:
    """A verifiers id as is; a dotted module path imported and registered under its last part
    (verifiers imports a taskset by its top-level name)."""
    if "." not in name or "/" in name:
        return name
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise EpisodeFailed(f"taskset {name}: {exc}") from None
    alias = name.rsplit(".", 1)[1]
    if sys.modules.setdefault(alias, module) is not module:
        raise EpisodeFailed(f"{name}: another module is already imported as {alias!r}")
    return alias


def _checked(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown or not isinstance(options.get("taskset"), str):
        raise EpisodeFailed(f"expected options {', '.join(OPTIONS)} with a taskset, got "
                            f"{json.dumps(options)}")
    return {"harness": "null", "tool_parser": "qwen3", "max_tokens": None,
            "max_turns": None, **options}


def load(options: dict) -> tuple[Any, list[Any]]:
    """The verifiers ``Env`` of ``options`` (its harness in the subprocess runtime) and its
    taskset's rows."""
    import verifiers.v1 as vf

    agent = {"harness": {"id": options["harness"]}, "runtime": {"type": "subprocess"},
             "max_turns": options["max_turns"]}
    config = {"taskset": {"id": _taskset_id(options["taskset"])}, "agent": agent}
    env = vf.load_environment(vf.resolve_env_config(config))
    rows = list(env.taskset)
    if not rows:
        raise EpisodeFailed(f"taskset {options['taskset']} has no tasks")
    return env, rows


async def episode(env: Any, rows: list[Any], task: Any, options: dict, *,
                  shared: bool) -> float:
    """One episode of ``env`` for the TideRL ``task``, through its endpoint: the reward.
    ``shared``: one client for every task of this process (each episode's trace id names its
    task, :func:`tiderl.env.agents.name_session`); else the task's key in ``OPENAI_API_KEY``."""
    import verifiers.v1 as vf
    from renderers.configs import DefaultRendererConfig

    if not task.model:
        raise EpisodeFailed("the job's model is a seeded size, not a folder: the renderer "
                            "needs the folder's tokenizer and chat template")
    text = (task.prompt or "").strip()
    row = rows[(int(text) if text.isdigit() else task.seed) % len(rows)]
    # the endpoint at its root (the client adds /inference/v1/generate): the same for every
    # task, so verifiers' interception server keeps one client for them all
    client = vf.TrainClientConfig(
        base_url=task.base_url.rsplit("/tasks/", 1)[0],
        # shared: a variable nobody sets (the key sent is verifiers' "EMPTY"; the session id
        # names the task); else the task's key, as a command agent is given it
        api_key_var="TIDERL_VERIFIERS_NO_KEY" if shared else "OPENAI_API_KEY",
        renderer=DefaultRendererConfig(tool_parser=options["tool_parser"]),
        renderer_model_name=task.model)
    context = vf.ModelContext(model=task.model, client=client,
                              sampling=vf.Sampling(max_tokens=options["max_tokens"]))
    on_trace = None
    if shared:
        from tiderl.env.agents import name_session

        def on_trace(trace: Any) -> None:  # minted before any model call
            name_session(trace.id)
    played = await env.run_episode(row, context, on_trace=on_trace)
    if not played.ok or not played.traces:
        error = played.last_error or next((e for t in played.traces for e in t.errors), None)
        raise EpisodeFailed(f"{error.type}: {error.message}" if error else "no trace")
    return sum(trace.reward for trace in played.traces)


_served: dict[str, asyncio.Future] = {}  # options (JSON) -> (the Env, serving; its rows)
_holders: set[asyncio.Task] = set()  # the tasks holding them (the loop keeps weak references)


async def _serve(options: dict, ready: asyncio.Future) -> None:
    """Hold ``env.serving()`` open in a task of its own (entered and left by the same task)
    until the service's event loop ends."""
    try:
        env, rows = load(options)
        async with env.serving():
            ready.set_result((env, rows))
            await asyncio.Event().wait()
    except Exception as exc:
        if not ready.done():
            ready.set_exception(exc)


async def run(task: Any, client: Any) -> float:
    """The entry agent: one episode of the environment ``task.options`` names."""
    del client  # verifiers' TrainClient calls the endpoint itself (token-in)
    options = _checked(task.options)
    key = json.dumps(options, sort_keys=True)
    if key not in _served:
        _served[key] = asyncio.get_running_loop().create_future()
        holder = asyncio.create_task(_serve(options, _served[key]))
        _holders.add(holder)
        holder.add_done_callback(_holders.discard)
    try:
        env, rows = await asyncio.shield(_served[key])
    except Exception:
        _served.pop(key, None)  # the next task tries again
        raise
    return await episode(env, rows, task, options, shared=True)


async def _play_once(task: Any) -> float:
    options = _checked(task.options)
    env, rows = load(options)
    async with env.serving():
        return await episode(env, rows, task, options, shared=False)


def main() -> None:
    from types import SimpleNamespace

    try:
        task = SimpleNamespace(**json.loads(os.environ["TIDERL_TASK"]))
    except (KeyError, ValueError, TypeError):
        raise SystemExit("verifiers_v1: TIDERL_TASK is not a task (it is set by a TideRL job's "
                         "environment service)") from None
    try:
        reward = asyncio.run(_play_once(task))
    except EpisodeFailed as exc:
        raise SystemExit(f"verifiers_v1: {exc}") from None
    print(json.dumps({"reward": reward}))


if __name__ == "__main__":
    main()
