"""The calc task as an agent on the OpenAI SDK: the usual tool loop, nothing TideRL-specific.

In a profile::

    env:
      envs: [calc-openai]
      agents:
        calc-openai: {entry: tiderl.examples.calc_openai:run}

``run_raw`` is the same agent sending and reading plain JSON through the client (no request or
response models: the SDK's own cost per request, a few milliseconds of CPU, left out).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx

from tiderl.examples.calc_common import (
    MAX_TURNS,
    NUDGE,
    SYSTEM,
    TOOLS,
    problem,
    run_calculator,
    score,
)

Ask = Callable[[list[dict]], Awaitable[dict]]  # the conversation -> the assistant message


async def run(task, client) -> float:
    """``task``: the :class:`tiderl.env.agents.AgentTask`; ``client``: an ``AsyncOpenAI`` on
    the task's endpoint. Returns the reward."""
    async def ask(messages: list[dict]) -> dict:
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=TOOLS)
        return reply.choices[0].message.model_dump(exclude_none=True)
    return await play(task, ask)


async def run_raw(task, client) -> float:
    async def ask(messages: list[dict]) -> dict:
        reply = await client.post("/chat/completions", cast_to=httpx.Response, body={
            "model": "policy", "messages": messages, "tools": TOOLS})
        return reply.json()["choices"][0]["message"]
    return await play(task, ask)


async def play(task, ask: Ask) -> float:
    question, answer = problem(task.prompt, task.seed)
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        message = await ask(messages)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            result = score(message.get("content"), answer)
            if result is not None:
                return result
            messages.append({"role": "user", "content": NUDGE})
            continue
        for call in calls:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:
                arguments = {}
            output = run_calculator(arguments) if isinstance(arguments, dict) \
                else "error: the arguments are not a JSON object"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    return 0.0
