"""Agents the endpoint tests run in a real environment service (their module is put on its
PYTHONPATH): each does one thing an agent may do."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx


async def hold(task, client) -> None:
    """Write where the task is served (its id, key and base URL) to the file the task text
    names, then wait: the test itself is the agent."""
    Path(task.prompt).write_text(json.dumps({"task_id": task.task_id, "key": task.api_key,
                                             "base_url": task.base_url}))
    await asyncio.sleep(3600)


async def raises(task, client) -> None:
    raise RuntimeError("the agent's own bug")


async def silent(task, client) -> float:
    return 1.0


async def sleeps(task, client) -> None:
    await asyncio.sleep(3600)


async def streams(task, client) -> float:
    """Two turns over streamed chat completions (with usage), the second extending the first."""
    messages = [{"role": "user", "content": "first"}]
    texts, usage = [], None
    for _ in range(2):
        stream = await client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True})
        text = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        texts.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    return 1.0 if texts == ["one", "two"] and usage and usage.completion_tokens == 2 else 0.0


async def trims(task, client) -> float:
    """A second request that drops the first turn (a summarised history)."""
    first = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "long history"}])
    await client.chat.completions.create(model="m", messages=[
        {"role": "user", "content": f"summary: {first.choices[0].message.content}"}])
    return 0.5


async def tokens_in(task, client) -> float:
    """Token-in turns as verifiers' client sends them: /inference/v1/generate, X-Session-ID."""
    base = task.base_url.rsplit("/tasks/", 1)[0]
    headers = {"Authorization": f"Bearer {task.api_key}", "X-Session-ID": task.task_id}
    ids: list[int] = [5, 6, 7]
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        for _ in range(2):
            answer = (await http.post("/inference/v1/generate", headers=headers, json={
                "model": "m", "token_ids": ids,
                "sampling_params": {"max_tokens": 4, "logprobs": 1}})).json()
            ids = ids + answer["choices"][0]["token_ids"] + [9]
    return 1.0


async def names_a_session(task, client) -> float:
    """Names a session id (refused: one too short to stand for a key), then makes a token-in
    turn at the root with it and a key that is no task's, as verifiers' TrainClient shared by
    many tasks does; 1.0 when all of that went as it should."""
    from tiderl.env.agents import name_session

    try:
        name_session("short")
        return 0.0
    except ValueError:
        pass
    session = f"trace-{task.task_id}-{task.api_key}"
    name_session(session)
    base = task.base_url.rsplit("/tasks/", 1)[0]
    body = {"model": "m", "token_ids": [5, 6], "sampling_params": {"max_tokens": 2}}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        answer = await http.post("/inference/v1/generate", json=body, headers={
            "Authorization": "Bearer EMPTY", "X-Session-ID": session})
    return 1.0 if answer.json()["choices"][0]["token_ids"] == [1, 2] else 0.0


async def renders(task, client) -> float:
    """Token-in turns as verifiers v1's TrainClient makes them: the prompt rendered by a
    ``renderers`` renderer (the model folder's chat template, the Hermes-style ``qwen3`` tool
    parser), sent by ``renderers.client.generate`` with a trace id of its own in
    ``X-Session-ID``; the next turn bridged from the exact prompt and completion ids
    (``bridge_to_next_turn``), or rendered whole where the renderer cannot bridge (the default
    renderer of a template it does not know never does)."""
    from renderers import create_renderer
    from renderers.client import generate
    from renderers.configs import DefaultRendererConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task.prompt, local_files_only=True)
    renderer = create_renderer(tokenizer, DefaultRendererConfig(tool_parser="qwen3"))
    tools = [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    headers = {"X-Session-ID": "trace-of-its-own"}
    first = await generate(client=client, renderer=renderer, messages=messages, tools=tools,
                           model="m", sampling_params={"max_tokens": 16},
                           extra_headers=headers)
    (call,) = first["tool_calls"]
    result = [{"role": "tool", "tool_call_id": "c0", "content": "5"}]
    messages += [{"role": "assistant", "content": first["content"] or "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": call.name,
                                                      "arguments": call.arguments}}]}, *result]
    bridged = renderer.bridge_to_next_turn(first["prompt_ids"], first["completion_ids"], result,
                                           tools=tools) \
        or renderer.render(messages, tools=tools, add_generation_prompt=True)
    second = await generate(client=client, renderer=renderer, messages=messages, tools=tools,
                            model="m", prompt_ids=bridged.token_ids,
                            sampling_params={"max_tokens": 16}, extra_headers=headers)
    return 1.0 if call.name == "calculator" and "5" in (second["content"] or "") else 0.0


async def anthropic_streams(task, client) -> float:
    """The Anthropic SDK's token count, then a streamed message (its event stream assembled by
    the SDK into text and a final message with usage)."""
    import anthropic

    messages = [{"role": "user", "content": "first"}]
    async with anthropic.AsyncAnthropic(base_url=task.anthropic_base_url,
                                        api_key=task.api_key) as anthropic_client:
        counted = await anthropic_client.messages.count_tokens(model="m", messages=messages)
        text = ""
        async with anthropic_client.messages.stream(model="m", max_tokens=8,
                                                    messages=messages) as stream:
            async for piece in stream.text_stream:
                text += piece
            final = await stream.get_final_message()
    return 1.0 if (text == "one" and final.stop_reason == "end_turn"
                   and final.usage.output_tokens == 2 and counted.input_tokens > 0) else 0.0
