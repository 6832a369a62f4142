"""The calc task as an agent on the OpenAI SDK: the usual tool loop, nothing TideRL-specific.

In a profile::

    env:
      envs: [calc-openai]
      agents:
        calc-openai: {entry: tiderl.examples.calc_openai:run}
"""

from __future__ import annotations

import json

from tiderl.examples.calc_common import MAX_TURNS, SYSTEM, TOOLS, problem, run_calculator, score


async def run(task, client) -> float:
    """``task``: the :class:`tiderl.env.agents.AgentTask`; ``client``: an ``AsyncOpenAI`` on
    the task's endpoint. Returns the reward."""
    question, answer = problem(task.prompt, task.seed)
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            result = score(message.content, answer)
            if result is not None:
                return result
            messages.append({"role": "user", "content": "Give the final value as "
                                                        "<answer>NUMBER</answer>."})
            continue
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = {}
            output = run_calculator(arguments) if isinstance(arguments, dict) \
                else "error: the arguments are not a JSON object"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 0.0
