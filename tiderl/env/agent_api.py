"""The model endpoint agents call: OpenAI chat completions, Anthropic messages, vLLM's token-in
generate, served per task by the environment service (:mod:`tiderl.env.agents`).

    POST /v1/chat/completions            OpenAI (tools, tool_calls, stream with usage)
    POST /v1/messages                    Anthropic (system, content blocks, tool_use, stream)
    POST /v1/messages/count_tokens       the prompt's tokens under the model's chat template
    GET  /v1/models                      the model, with its context length (max_model_len)
    POST /inference/v1/generate          vLLM's token-in schema (token_ids, sampling_params)
    POST /tasks/{task_id}/reward         {"reward": r}: the task's reward, if the agent gives it
    POST /tasks/{task_id}/finish         the agent is done: the task ends with its reward

Each route is also served under ``/tasks/{task_id}`` (``/tasks/{task_id}/v1/chat/completions``:
the base URL an agent is given). A request names its task by that path, or by its key alone
(``Authorization: Bearer KEY`` or ``x-api-key: KEY``; ``X-Session-ID: TASK_ID`` names it where
the key does not); the key is always required, and a key that is not the task's is 401 — except
at the root with an ``X-Session-ID`` its task named (:func:`tiderl.env.agents.name_session`),
which stands for the key. An
SDK's retry of a request (``x-stainless-retry-count`` > 0, the same body) is answered with the
first attempt's answer, never generated twice.

The model's answer is whole when it comes back from the rank, so a stream sends it in one piece
of each kind (OpenAI: role, content, each tool call, finish, usage; Anthropic: message_start,
one block per text and tool_use, message_delta, message_stop), the events the SDKs parse.

Sampling: the rank samples with the job's temperature and top_p (the policy being trained, whose
behaviour logprobs the trainer corrects by), whatever a request asks; it honours ``max_tokens``
(capped by the job's ``engine.max_new_tokens``), ``stop`` strings and token ids, and ``seed``.

Errors are one line in the dialect's shape: OpenAI ``{"error": {"message", "type", "param",
"code"}}``, Anthropic ``{"type": "error", "error": {"type", "message"}}``; 400 malformed JSON, an
unsupported parameter (named), ``n`` > 1, a prompt over the context length (the limit named);
401 no key or a wrong one; 404 an unknown task; 409 a finished or dropped task; 429 a task with
too many requests waiting.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tiderl.core.quote import short
from tiderl.env.agent_wire import (
    ApiError,
    chat_answer,
    chat_stream,
    generate_answer,
    messages_answer,
    messages_stream,
    parse_chat,
    parse_generate,
    parse_messages,
)
from tiderl.env.agents import (
    AgentRun,
    Answer,
    ModelRequest,
    RequestRefused,
    TaskClosed,
    TooManyRequests,
    body_digest,
)
from tiderl.env.service import EnvService

RETRY_HEADER = "x-stainless-retry-count"
SESSION_HEADER = "x-session-id"
AGENT_PREFIXES = ("/v1/", "/tasks/", "/inference/")


def is_agent_path(path: str) -> bool:
    return path.startswith(AGENT_PREFIXES)


@dataclass
class AgentModel:
    """What the endpoint tells agents about the model: its name, its context length, and how
    to count a conversation's tokens (None: count_tokens is not served)."""

    name: str = "tiderl"
    context_tokens: int = 4096
    count: Callable[[list[dict], list[dict]], int] | None = None
    path: str = ""  # the model folder, "" for a seeded model


# ---------------------------------------------------------------------------- routes


def openai_error(exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": {"message": str(exc), "type": exc.kind, "param": exc.param,
                                   "code": None}}, status_code=exc.status)


def anthropic_error(exc: ApiError) -> JSONResponse:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             409: "invalid_request_error", 429: "rate_limit_error"}
    return JSONResponse({"type": "error", "error": {"type": kinds.get(exc.status, "api_error"),
                                                    "message": str(exc)}},
                        status_code=exc.status)


class AgentRoutes:
    """The routes over one service's agent runs."""

    def __init__(self, service: EnvService, model: AgentModel) -> None:
        self.service, self.model = service, model

    def find(self, request: Request, task_id: str | None) -> AgentRun:
        """The run a request is for: by path, ``X-Session-ID`` or key; the key must be its (a
        session id its task named stands for the key)."""
        service = self.service
        session = request.headers.get(SESSION_HEADER)
        if not task_id and session and (named := service.agent_sessions.get(session)):
            return named
        key = request.headers.get("x-api-key") or ""
        auth = request.headers.get("authorization", "")
        if not key and auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        if not key:
            raise ApiError(401, "no key: send the task's key as Authorization: Bearer KEY or "
                           "x-api-key", "authentication_error")
        # the key names its task; X-Session-ID (a router's hint, verifiers sends its own trace
        # id there) only names one when the key does not
        run = service.agents.get(task_id) if task_id else service.agent_keys.get(key)
        task_id = task_id or (None if run else request.headers.get(SESSION_HEADER))
        if run is None and task_id:
            run = service.agents.get(task_id)
        if run is None:
            if task_id and task_id in service.ended_agents:
                raise ApiError(409, f"task {short(task_id)} has ended", "task_ended")
            if not task_id and key in service.ended_agents:
                raise ApiError(409, "the task of this key has ended", "task_ended")
            if task_id:
                raise ApiError(404, f"unknown task {short(task_id)}", "not_found_error")
            raise ApiError(401, "the key is not a task's key", "authentication_error")
        if not secrets.compare_digest(key, run.task.api_key):
            raise ApiError(401, f"the key is not task {short(run.task.task_id)}'s",
                           "authentication_error")
        return run

    async def ask(self, request: Request, task_id: str | None,
                  parse: Callable[[dict[str, Any]], ModelRequest]) -> tuple[Answer, dict]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "malformed JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "expected a JSON object")
        run = self.find(request, task_id)
        model_request = parse(body)
        model_request.digest = body_digest(raw)
        retry = request.headers.get(RETRY_HEADER, "0") not in ("", "0")
        try:
            return await run.ask(model_request, retry), body
        except TaskClosed as exc:
            raise ApiError(409, str(exc), "task_ended") from None
        except TooManyRequests as exc:
            raise ApiError(429, str(exc), "rate_limit_error") from None
        except RequestRefused as exc:
            raise ApiError(400, str(exc), param="messages") from None


def _chat_request(body: dict[str, Any]) -> ModelRequest:
    messages, tools, sampling = parse_chat(body)
    return ModelRequest(messages, tools, None, sampling, "")


def _messages_request(body: dict[str, Any]) -> ModelRequest:
    messages, tools, sampling = parse_messages(body)
    return ModelRequest(messages, tools, None, sampling, "")


def _generate_request(body: dict[str, Any]) -> ModelRequest:
    ids, sampling = parse_generate(body)
    return ModelRequest(None, [], ids, sampling, "")


def _sse(events: list[str]) -> StreamingResponse:
    async def gen() -> AsyncIterator[str]:
        for event in events:
            yield event
    return StreamingResponse(gen(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


def add_agent_routes(app: FastAPI, service: EnvService, model: AgentModel) -> None:
    """The endpoint's routes, at the root and under ``/tasks/{task_id}``."""
    routes = AgentRoutes(service, model)

    def both(path: str, handler: Callable, methods: list[str]) -> None:
        app.add_api_route(path, handler, methods=methods)
        app.add_api_route("/tasks/{task_id}" + path, handler, methods=methods)

    def dialect(parse: Callable[[dict[str, Any]], ModelRequest],
                error: Callable[[ApiError], JSONResponse],
                whole: Callable[[Answer, dict], dict],
                stream: Callable[[Answer, dict], list[str]]) -> Callable:
        """A model route: the request parsed, its answer awaited, then sent whole or as SSE."""
        async def route(request: Request, task_id: str | None = None) -> Response:
            try:
                answer, body = await routes.ask(request, task_id, parse)
            except ApiError as exc:
                return error(exc)
            if body.get("stream"):
                return _sse(stream(answer, body))
            return JSONResponse(whole(answer, body))
        return route

    chat = dialect(_chat_request, openai_error,
                   lambda a, body: chat_answer(a, model.name, bool(body.get("logprobs"))),
                   lambda a, body: chat_stream(a, model.name, bool(
                       (body.get("stream_options") or {}).get("include_usage"))))
    messages = dialect(_messages_request, anthropic_error,
                       lambda a, _: messages_answer(a, model.name),
                       lambda a, _: messages_stream(a, model.name))
    generate = dialect(_generate_request, openai_error,  # parse_generate refuses stream
                       lambda a, _: generate_answer(a, model.name), lambda a, _: [])

    async def count_tokens(request: Request, task_id: str | None = None) -> Response:
        try:
            routes.find(request, task_id)
            try:
                body = json.loads(await request.body())
            except (ValueError, RecursionError):
                raise ApiError(400, "malformed JSON") from None
            if not isinstance(body, dict):
                raise ApiError(400, "expected a JSON object")
            body.pop("max_tokens", None)
            found, tools, _ = parse_messages(body, counting=True)
            if model.count is None:
                raise ApiError(400, "count_tokens: this job's model has no tokenizer here")
            plain = [msgspec.to_builtins(m) for m in found]
            counted = await asyncio.to_thread(model.count, plain, tools)
            return JSONResponse({"input_tokens": counted})
        except ApiError as exc:
            return anthropic_error(exc)

    async def models(request: Request, task_id: str | None = None) -> Response:
        try:
            routes.find(request, task_id)
        except ApiError as exc:
            return openai_error(exc)
        return JSONResponse({"object": "list", "data": [
            {"id": model.name, "object": "model", "created": 0, "owned_by": "tiderl",
             "max_model_len": model.context_tokens}]})

    both("/v1/chat/completions", chat, ["POST"])
    both("/v1/messages", messages, ["POST"])
    both("/v1/messages/count_tokens", count_tokens, ["POST"])
    both("/v1/models", models, ["GET"])
    both("/inference/v1/generate", generate, ["POST"])

    @app.post("/tasks/{task_id}/reward")
    async def reward(request: Request, task_id: str) -> Response:
        try:
            run = routes.find(request, task_id)
            try:
                value = json.loads(await request.body()).get("reward")
            except (ValueError, AttributeError, RecursionError):
                raise ApiError(400, "expected {\"reward\": NUMBER}") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or value != value or value in (float("inf"), float("-inf")):
                raise ApiError(400, f"reward: expected a finite number, got {short(value)}",
                               param="reward")
            run.set_reward(float(value))
        except TaskClosed as exc:
            return openai_error(ApiError(409, str(exc), "task_ended"))
        except ApiError as exc:
            return openai_error(exc)
        return JSONResponse({"task_id": task_id, "reward": float(value)})

    @app.post("/tasks/{task_id}/finish")
    async def finish(request: Request, task_id: str) -> Response:
        try:
            run = routes.find(request, task_id)
            run.finish()
        except TaskClosed as exc:
            return openai_error(ApiError(409, str(exc), "task_ended"))
        except ApiError as exc:
            return openai_error(exc)
        return JSONResponse({"task_id": task_id, "finished": True})
