"""The calc task as an agent on the Anthropic SDK (Messages API, ``tool_use`` blocks).

In a profile::

    env:
      envs: [calc-anthropic]
      agents:
        calc-anthropic: {entry: tiderl.examples.calc_anthropic:run}
"""

from __future__ import annotations

from tiderl.examples import calc_common as calc

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in calc.TOOLS]


async def run(task, _client) -> float:
    """An Anthropic client on the task's endpoint (the OpenAI one it is given goes unused)."""
    import anthropic  # the agents extra

    question, answer = calc.problem(task.prompt, task.seed)
    messages: list[dict] = [{"role": "user", "content": question}]
    async with anthropic.AsyncAnthropic(base_url=task.anthropic_base_url,
                                        api_key=task.api_key) as client:
        for _ in range(calc.MAX_TURNS):
            reply = await client.messages.create(model="policy", max_tokens=256, system=calc.SYSTEM,
                                                 messages=messages, tools=ANTHROPIC_TOOLS)
            messages.append({"role": "assistant",
                             "content": [block.model_dump(exclude_none=True)
                                         for block in reply.content]})
            calls = [block for block in reply.content if block.type == "tool_use"]
            if not calls:
                text = "".join(block.text for block in reply.content if block.type == "text")
                result = calc.score(text, answer)
                if result is not None:
                    return result
                messages.append({"role": "user", "content": calc.NUDGE})
                continue
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id,
                 "content": calc.run_calculator(call.input if isinstance(call.input, dict) else {})}
                for call in calls]})
    return 0.0
