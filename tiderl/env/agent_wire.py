"""The agent endpoint's dialects on the wire (:mod:`tiderl.env.agent_api` serves them): OpenAI
chat completions, Anthropic messages and vLLM's token-in generate bodies parsed into messages,
tools and per-turn sampling, and the rank's answer written back in each dialect, whole or as the
SSE events its SDK parses. Every refusal is an :class:`ApiError` naming what it refuses."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from tiderl.core.quote import short
from tiderl.env.agents import Answer
from tiderl.env.images import ImageError
from tiderl.env.protocol import (
    ImagePart,
    ImageURL,
    Message,
    TextPart,
    ToolCall,
    ToolFunction,
)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def _unsupported(name: str, value: Any = None) -> ApiError:
    shown = "" if value is None else f" {short(value)}"
    return ApiError(400, f"unsupported parameter: {name}{shown}", param=name)


# ---------------------------------------------------------------------------- requests: OpenAI

CHAT_PARAMS = {"model", "messages", "tools", "tool_choice", "max_tokens",
               "max_completion_tokens", "temperature", "top_p", "stop", "seed", "n", "stream",
               "stream_options", "user", "metadata", "parallel_tool_calls", "logprobs",
               "top_logprobs", "store", "frequency_penalty", "presence_penalty"}


def parse_chat(body: dict[str, Any]) -> tuple[list[Message], list[dict], dict[str, Any]]:
    """An OpenAI chat completions body: its messages, tools and per-turn sampling."""
    _known(body, CHAT_PARAMS)
    if body.get("n", 1) != 1:
        raise ApiError(400, f"n: only n=1 is served (one sample per request), got "
                       f"{short(body.get('n'))}", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _unsupported(name, body[name])
    if body.get("top_logprobs"):
        raise _unsupported("top_logprobs", body["top_logprobs"])
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _unsupported("tool_choice", choice)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages: expected a non-empty list", param="messages")
    messages = [_openai_message(m, i) for i, m in enumerate(raw)]
    tools = [] if choice == "none" else _list(body.get("tools"), "tools")
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
                and isinstance(tool.get("function"), dict)
                and isinstance(tool["function"].get("name"), str)):
            raise ApiError(400, f"tools[{i}]: expected {{\"type\": \"function\", "
                           "\"function\": {\"name\", ...}}", param="tools")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return messages, tools, _sampling(limit, body.get("stop"), body.get("seed"))


def _openai_message(raw: Any, i: int) -> Message:
    if not isinstance(raw, dict):
        raise ApiError(400, f"messages[{i}]: expected an object", param="messages")
    role = raw.get("role")
    if role == "developer":
        role = "system"
    content = raw.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = [_openai_part(part, i) for part in content]
    elif not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content: expected a string or a list of parts",
                       param="messages")
    calls = None
    if raw.get("tool_calls"):
        calls = []
        for call in _list(raw["tool_calls"], f"messages[{i}].tool_calls"):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ApiError(400, f"messages[{i}].tool_calls: expected {{\"id\", "
                               "\"function\": {\"name\", \"arguments\"}}", param="messages")
            arguments = function.get("arguments", "")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(str(call.get("id", "")), ToolFunction(function["name"],
                                                                         arguments)))
    tool = role == "tool"
    try:
        return Message(role=role, content=content, tool_calls=calls,
                       tool_call_id=raw.get("tool_call_id") if tool else None,
                       name=raw.get("name") if tool else None)
    except (ValueError, TypeError, ImageError) as exc:
        raise ApiError(400, f"messages[{i}]: {exc}", param="messages") from None


def _openai_part(part: Any, i: int) -> TextPart | ImagePart:
    kind = part.get("type") if isinstance(part, dict) else None
    try:
        if kind == "text" and isinstance(part.get("text"), str):
            return TextPart(part["text"])
        if kind == "image_url" and isinstance(part.get("image_url"), dict):
            return ImagePart(ImageURL(str(part["image_url"].get("url", ""))))
    except ImageError as exc:
        raise ApiError(400, f"messages[{i}]: {exc}", param="messages") from None
    raise ApiError(400, f"messages[{i}].content: unsupported part {short(kind)} (text and "
                   "PNG image_url parts are served)", param="messages")


# ------------------------------------------------------------------------- requests: Anthropic

MESSAGES_PARAMS = {"model", "messages", "system", "max_tokens", "tools", "tool_choice",
                   "stop_sequences", "temperature", "top_p", "top_k", "metadata", "stream",
                   "thinking", "service_tier"}


def parse_messages(body: dict[str, Any], *, counting: bool = False
                   ) -> tuple[list[Message], list[dict], dict[str, Any]]:
    """An Anthropic Messages body as OpenAI-style messages and tools (``system`` first, each
    ``tool_result`` block a tool message, ``tool_use`` blocks tool calls)."""
    _known(body, MESSAGES_PARAMS)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise _unsupported("thinking", thinking.get("type"))
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind not in (None, "auto", "none"):
        raise _unsupported("tool_choice", kind)
    if not counting and not isinstance(body.get("max_tokens"), int):
        raise ApiError(400, "max_tokens: required, a whole number", param="max_tokens")
    messages: list[Message] = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else "\n".join(
            _block_text(block, "system") for block in _list(system, "system"))
        messages.append(Message(role="system", content=text))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages: expected a non-empty list", param="messages")
    for i, message in enumerate(raw):
        messages += _anthropic_message(message, i)
    tools = [] if kind == "none" else [_anthropic_tool(t, i) for i, t in
                                       enumerate(_list(body.get("tools"), "tools"))]
    return messages, tools, _sampling(body.get("max_tokens"), body.get("stop_sequences"), None)


def _anthropic_message(raw: Any, i: int) -> list[Message]:
    role = raw.get("role") if isinstance(raw, dict) else None
    if role not in ("user", "assistant"):
        raise ApiError(400, f"messages[{i}].role: expected user or assistant, got "
                       f"{short(role)}", param="messages")
    content = raw.get("content", "")
    if isinstance(content, str):
        return [Message(role=role, content=content)]
    out: list[Message] = []
    parts: list[TextPart | ImagePart] = []
    calls: list[ToolCall] = []
    for block in _list(content, f"messages[{i}].content"):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(TextPart(_block_text(block, f"messages[{i}]")))
        elif kind == "image" and role == "user":
            parts.append(_anthropic_image(block, i))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(ToolCall(str(block.get("id", "")), ToolFunction(
                str(block.get("name", "")), arguments)))
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else "\n".join(
                _block_text(b, f"messages[{i}]") for b in _list(result, f"messages[{i}]"))
            out.append(Message(role="tool", content=text,
                               tool_call_id=str(block.get("tool_use_id", ""))))
        else:
            raise ApiError(400, f"messages[{i}].content: unsupported block {short(kind)} for "
                           f"{role}", param="messages")
    if parts or calls or not out:
        text_only = all(isinstance(p, TextPart) for p in parts)
        body: str | list = "\n".join(p.text for p in parts) if text_only else parts
        out.append(Message(role=role, content=body, tool_calls=calls or None))
    return out


def _anthropic_image(block: dict, i: int) -> ImagePart:
    source = block.get("source") or {}
    if source.get("type") != "base64" or source.get("media_type") != "image/png":
        raise ApiError(400, f"messages[{i}]: only base64 PNG images are served",
                       param="messages")
    try:
        return ImagePart(ImageURL(f"data:image/png;base64,{source.get('data', '')}"))
    except ImageError as exc:
        raise ApiError(400, f"messages[{i}]: {exc}", param="messages") from None


def _anthropic_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise ApiError(400, f"tools[{i}]: expected {{\"name\", \"input_schema\", ...}}",
                       param="tools")
    function = {"name": tool["name"], "description": tool.get("description", ""),
                "parameters": tool.get("input_schema", {"type": "object"})}
    return {"type": "function", "function": function}


def _block_text(block: Any, where: str) -> str:
    if not (isinstance(block, dict) and block.get("type") == "text"
            and isinstance(block.get("text"), str)):
        raise ApiError(400, f"{where}: expected text blocks", param="messages")
    return block["text"]


# ------------------------------------------------------------------------- requests: token-in

GENERATE_PARAMS = {"model", "token_ids", "sampling_params", "request_id", "cache_salt",
                   "priority", "stream", "output_mode", "return_token_ids"}
TOKEN_SAMPLING_PARAMS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                         "stop_token_ids", "logprobs", "n", "detokenize", "skip_special_tokens",
                         "include_stop_str_in_output", "repetition_penalty", "min_tokens",
                         "ignore_eos", "spaces_between_special_tokens"}


def parse_generate(body: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """vLLM's ``/inference/v1/generate`` body: the prompt's ids and per-turn sampling."""
    _known(body, GENERATE_PARAMS)
    if body.get("stream"):
        raise _unsupported("stream", True)
    if body.get("output_mode", "tokens") != "tokens":
        raise _unsupported("output_mode", body["output_mode"])
    ids = body.get("token_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool)
                                                  and t >= 0 for t in ids)):
        raise ApiError(400, "token_ids: expected a non-empty list of token ids",
                       param="token_ids")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ApiError(400, "sampling_params: expected an object", param="sampling_params")
    _known(params, TOKEN_SAMPLING_PARAMS, "sampling_params.")
    if params.get("n", 1) != 1:
        raise ApiError(400, "sampling_params.n: only n=1 is served", param="sampling_params")
    for name, neutral in (("repetition_penalty", 1), ("min_tokens", 0), ("ignore_eos", False),
                          ("include_stop_str_in_output", False)):
        if params.get(name, neutral) not in (neutral, None):
            raise _unsupported(f"sampling_params.{name}", params[name])
    sampling = _sampling(params.get("max_tokens"), params.get("stop"), params.get("seed"))
    stop_ids = params.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(isinstance(t, int) for t in stop_ids)):
        raise ApiError(400, "sampling_params.stop_token_ids: expected a list of token ids",
                       param="sampling_params")
    if stop_ids:
        sampling["stop_token_ids"] = stop_ids
    return ids, sampling


# ---------------------------------------------------------------------------- shared parsing


def _known(body: dict[str, Any], known: set[str], prefix: str = "") -> None:
    for name in body:
        if name not in known:
            raise _unsupported(f"{prefix}{name}")


def _list(value: Any, name: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"{name}: expected a list", param=name)
    return value


def _sampling(max_tokens: Any, stop: Any, seed: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ApiError(400, f"max_tokens: expected a positive whole number, got "
                           f"{short(max_tokens)}", param="max_tokens")
        out["max_tokens"] = max_tokens
    if stop:
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise ApiError(400, "stop: expected a string or a list of strings", param="stop")
        out["stop"] = stops
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ApiError(400, f"seed: expected a whole number, got {short(seed)}",
                           param="seed")
        out["seed"] = seed
    return out


# ---------------------------------------------------------------------------- answers


def _usage(answer: Answer) -> dict[str, Any]:
    c = answer.completion
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids),
            "total_tokens": c.prompt_tokens + len(c.token_ids),
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def _finish(answer: Answer) -> str:
    if answer.message.tool_calls:
        return "tool_calls"
    return "length" if answer.completion.finish_reason == "length" else "stop"


def _tool_calls(answer: Answer) -> list[dict[str, Any]]:
    return [{"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for call in answer.message.tool_calls or ()]


def _logprobs(answer: Answer) -> dict[str, Any]:
    c = answer.completion
    return {"content": [{"token": f"token_id:{t}", "logprob": p, "bytes": None,
                         "top_logprobs": []} for t, p in zip(c.token_ids, c.logprobs, strict=True)]}


def chat_answer(answer: Answer, model: str, logprobs: bool) -> dict[str, Any]:
    content = answer.message.text()
    message: dict[str, Any] = {"role": "assistant",
                               "content": content if content or not answer.message.tool_calls
                               else None}
    if answer.message.tool_calls:
        message["tool_calls"] = _tool_calls(answer)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(answer),
                         "logprobs": _logprobs(answer) if logprobs else None}],
            "usage": _usage(answer)}


def chat_stream(answer: Answer, model: str, include_usage: bool) -> list[str]:
    """The SSE events of a streamed chat completion, whole."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                    "logprobs": None}]}
        if include_usage:
            out["usage"] = None
        return out

    chunks = [chunk({"role": "assistant", "content": ""})]
    if text := answer.message.text():
        chunks.append(chunk({"content": text}))
    for i, call in enumerate(_tool_calls(answer)):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, _finish(answer)))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(answer)})
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def _stop_reason(answer: Answer) -> tuple[str, str | None]:
    if answer.message.tool_calls:
        return "tool_use", None
    if answer.completion.stop:
        return "stop_sequence", answer.completion.stop
    return ("max_tokens" if answer.completion.finish_reason == "length" else "end_turn"), None


def _blocks(answer: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if text := answer.message.text():
        blocks.append({"type": "text", "text": text})
    for call in answer.message.tool_calls or ():
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # Anthropic's input is an object
            arguments = {"arguments": call.function.arguments}
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                       "input": arguments})
    return blocks


def messages_answer(answer: Answer, model: str) -> dict[str, Any]:
    reason, sequence = _stop_reason(answer)
    c = answer.completion
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": model, "content": _blocks(answer), "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": len(c.token_ids),
                      "cache_read_input_tokens": c.cached_tokens}}


def messages_stream(answer: Answer, model: str) -> list[str]:
    whole = messages_answer(answer, model)
    start = {**whole, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**whole["usage"], "output_tokens": 0}}
    events: list[tuple[str, dict]] = [("message_start", {"type": "message_start",
                                                         "message": start})]
    for index, block in enumerate(whole["content"]):
        if block["type"] == "text":
            events += [("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": {"type": "text", "text": ""}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "text_delta",
                                                          "text": block["text"]}})]
        else:
            events += [("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": {**block, "input": {}}}),
                       ("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "input_json_delta",
                                                          "partial_json":
                                                          json.dumps(block["input"])}})]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events += [("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": whole["stop_reason"],
                                            "stop_sequence": whole["stop_sequence"]},
                                  "usage": {"output_tokens": whole["usage"]["output_tokens"]}}),
               ("message_stop", {"type": "message_stop"})]
    return [f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events]


def generate_answer(answer: Answer, model: str) -> dict[str, Any]:
    c = answer.completion
    # vLLM 0.34's field (token_id) and the string form renderers' client checks (token)
    logprobs = [{"token_id": t, "token": f"token_id:{t}", "logprob": p, "top_logprobs": []}
                for t, p in zip(c.token_ids, c.logprobs, strict=True)]
    return {"request_id": uuid.uuid4().hex, "model": model, "created": int(time.time()),
            "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop or None, "token_ids": c.token_ids,
                         "logprobs": {"content": logprobs},
                         "weight_versions": [{"version": str(c.version), "start": 0,
                                              "end": len(c.token_ids)}]}],
            "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids),
                      "total_tokens": c.prompt_tokens + len(c.token_ids)}}
