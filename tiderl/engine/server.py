"""HTTP server of the embedded engine: OpenAI-compatible token-id completions, Prometheus
metrics and admin routes.

    client ──POST /v1/completions──> build_app ──engine.generate()──> LLMEngine (step loop)
           ──GET /metrics──────────> EngineCollector ──engine.metrics()── (read on each scrape)
           ──/tiderl/{pin,unpin,forget,usage,update_weights,flush}──> engine admin calls
           ──/tiderl/{sleep,wake_up}──> free / reload the weights and the KV cache (ERS moves)

Every route under ``/tiderl/`` is an admin route: with an admin token (``serve_loading``'s
``admin_token``, else ``TIDERL_ADMIN_TOKEN``, else the job's, see :mod:`tiderl.auth`) it needs
``Authorization: Bearer TOKEN`` (else 401); without one it answers loopback clients only (else
403). A job always sets one. ``/v1/*``, ``/health`` and ``/metrics`` are open, as on vLLM
without ``--api-key``.

A pin that would leave too little of the KV pool for the largest request in the engine is
refused 409 (``pin_refused``): the task goes on unpinned. A completion without ``task_id`` is
forgotten when it returns; a task's state otherwise lives until ``/tiderl/forget`` or
``/tiderl/flush``. ``max_tokens`` is cut to the context left after the prompt (as vLLM).
For a model that reads images, a completion's ``images`` (TideRL extra: key, offset,
num_tokens, grid and the base64 PNG of each image among the prompt ids) are encoded once per
content hash and key the prefix cache (:mod:`tiderl.engine.multimodal`). An image sent before
may come by its key alone (no ``png``): where the engine no longer holds its embeddings the
completion is answered 409 ``image_missing`` with the ``keys`` to send again with their bytes.

:func:`tiderl.engine.loading_server.serve_loading` opens the socket before the engine exists: until
:func:`build_app` serves, ``/health`` answers 503 ``{"status": "loading"}``, so that 200 keeps
meaning "ready to generate", and every other route 503 ``loading``. While the engine sleeps (its
rank trains) a completion is answered 503 ``asleep`` (``Retry-After: 1``; ``/health`` says
``asleep: true``): a completion gets ``choices`` or, while the engine is not ready, a 503.

Bad input (malformed JSON, wrong types, an empty prompt, token ids outside the vocabulary, a
prompt that leaves no room in the context, images that do not match the prompt or their pixels,
an unknown route, a body over ``MAX_BODY_BYTES``) is
answered 4xx with ``{"error": {"message", "type"}}``; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException

from tiderl.auth import ServiceGuard, error_body
from tiderl.core.quote import cut
from tiderl.core.types import ImageRef
from tiderl.engine.kv_cache_manager import PinRefused
from tiderl.engine.metric_names import TIDERL_ENGINE
from tiderl.engine.multimodal import ImagesMissing
from tiderl.engine.request import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from tiderl.engine.llm_engine import LLMEngine

PREFIX = "tiderl:"
ADMIN_PREFIX = "/tiderl/"
MAX_BODY_BYTES = 8 << 20  # a 131,072-token prompt is about 1 MiB of JSON
MAX_TASK_ID_CHARS = 256
RETRY_AFTER = {"Retry-After": "1"}  # on a 503: the server is up but cannot generate yet


# -- request and response bodies -----------------------------------------------------------------

class CompletionRequest(BaseModel):
    """OpenAI ``/v1/completions`` with a token-id prompt; unknown OpenAI fields are ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    prompt: list[StrictInt]
    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # any value returns the sampled tokens' logprobs (no top-k)
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    task_id: str | None = Field(None, min_length=1, max_length=MAX_TASK_ID_CHARS)  # TideRL
    # extra: the task whose KV a pin keeps
    images: list[ImageBody] = Field(default_factory=list, max_length=64)  # TideRL extra
    stream: bool = False  # accepted only as False
    n: int = 1  # accepted only as 1


class ImageBody(BaseModel):
    """An image among a completion's prompt ids (TideRL extra, a model that reads images): its
    ``num_tokens`` image-pad tokens start at ``offset``; ``key`` is the sha256 of ``png``
    (base64), its pixels (omitted: sent before, named by its key alone); ``grid`` its
    (t, h, w) patch grid."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=64, max_length=64)
    offset: StrictInt
    num_tokens: StrictInt
    grid: tuple[StrictInt, StrictInt, StrictInt]
    png: str | None = Field(default=None, min_length=1)


class TaskBody(BaseModel):
    task_id: str = Field(min_length=1, max_length=MAX_TASK_ID_CHARS)


class UpdateWeightsBody(BaseModel):
    path: str = Field(min_length=1)  # a folder of *.safetensors (HF names)
    version: int


class NotReady(Exception):
    """The engine cannot generate now (asleep while its rank trains, or waking): answered 503
    with ``Retry-After``, as while it loads (:mod:`tiderl.engine.loading_server`)."""


class EngineCollector:
    """Reads ``engine.metrics()`` at scrape time; counters gain ``_total`` on exposition. The
    names the clients and ``profile kv`` read are ``TIDERL_ENGINE``'s (metric_names.py)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        m, names = self.engine.metrics(), TIDERL_ENGINE
        counters = (
            (names.queries, m.prefix_cache_queries, "Prompt tokens looked up."),
            (names.hits, m.prefix_cache_hits, "Prompt tokens found in the cache."),
            (names.preemptions, m.num_preemptions, "Requests preempted (recompute)."),
            (names.prefilled_tokens, m.prompt_tokens_computed,
             "Prompt tokens prefilled."),
            (PREFIX + "decode_tokens", m.decode_tokens, "Tokens sampled."),
            (names.prefill_seconds, m.prefill_s,
             "Step seconds spent on prompt positions (each step's by token share)."),
            (PREFIX + "pins", m.num_pins, "Pins taken (a task's context held between its turns)."),
            (PREFIX + "pins_released", m.num_pins_released,
             "Pins dropped so that a request could fit beside them."),
        )
        for name, value, doc in counters:
            yield CounterMetricFamily(name, doc, value=value)
        gauges = (
            (names.usage, m.kv_cache_usage_perc, "Fraction of KV blocks referenced."),
            (names.running, m.num_requests_running, "Requests running."),
            (names.waiting, m.num_requests_waiting, "Requests waiting."),
            (PREFIX + "num_tasks", m.num_tasks, "Tasks with per-task state (a context or a pin)."),
            (PREFIX + "weight_version", self.engine.version, "Version of the loaded weights."),
        )
        for name, value, doc in gauges:
            yield GaugeMetricFamily(name, doc, value=value)


# -- app -----------------------------------------------------------------------------------------

def error_response(status: int, message: str, kind: str,
                   headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(message, kind, **extra), status_code=status,
                        headers=headers)


def _png(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"images: png is not base64: {exc}") from None


def validate_prompt(engine: LLMEngine, prompt: list[int]) -> None:
    """The engine checks these too; checking here keeps every answer a clear 400."""
    if not prompt:
        raise ValueError("prompt: empty (expected at least one token id)")
    bad = next((t for t in prompt if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt: token id {bad} outside the vocabulary [0, {engine.vocab_size})")
    if len(prompt) > engine.max_model_len:
        raise ValueError(f"prompt: {len(prompt)} tokens, longer than the context "
                         f"({engine.max_model_len})")
    if len(prompt) == engine.max_model_len:
        raise ValueError(f"prompt: {len(prompt)} tokens fill the context "
                         f"({engine.max_model_len}): no room for an output token")


def build_app(engine: LLMEngine, tokenizer: Tokenizer | None = None,
              model_name: str = "tiderl", admin_token: str | None = None) -> FastAPI:
    """The server's routes over one engine; each app has its own Prometheus registry.
    ``admin_token`` None: the admin routes answer loopback clients only."""
    from tiderl.engine.llm_engine import EngineAsleepError  # late: torch (loaded with the engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.close()

    app = FastAPI(title="TideRL engine", lifespan=lifespan, redirect_slashes=False)
    app.add_middleware(ServiceGuard, token=admin_token,
                       is_protected=lambda path: path.startswith(ADMIN_PREFIX),
                       max_body_bytes=MAX_BODY_BYTES, loopback_without_token=True)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))  # type: ignore[arg-type]
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "version": engine.version, "asleep": engine.is_asleep}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict:
        if body.stream or body.n != 1:
            raise ValueError("stream and n > 1 are not supported (one choice, one response)")
        validate_prompt(engine, body.prompt)
        sampling = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature,
                                  top_p=body.top_p, seed=body.seed,
                                  stop_token_ids=tuple(body.stop_token_ids))
        task_id = body.task_id or uuid.uuid4().hex
        images = [(ImageRef(i.key, i.offset, i.num_tokens, i.grid),
                   None if i.png is None else _png(i.png)) for i in body.images]
        try:
            out = await engine.generate(task_id, list(body.prompt), sampling, images)
        except EngineAsleepError:  # no weights until /tiderl/wake_up: not ready, not wrong
            raise NotReady("the engine is asleep (no weights until /tiderl/wake_up): retry "
                           "when /health answers asleep false") from None
        finally:
            if body.task_id is None:  # nobody can come back for it
                await asyncio.to_thread(engine.forget, task_id)
        return _completion_response(out, body, model_name, tokenizer)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await asyncio.to_thread(generate_latest, registry)  # waits for a step's lock
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/tiderl/pin")
    async def pin(body: TaskBody) -> dict:
        num_tokens = await asyncio.to_thread(engine.pin, body.task_id)
        return {"task_id": body.task_id, "num_pinned_tokens": num_tokens}

    @app.post("/tiderl/unpin")
    async def unpin(body: TaskBody) -> dict:
        await asyncio.to_thread(engine.unpin, body.task_id)
        return {"task_id": body.task_id, "pinned": False}

    @app.post("/tiderl/forget")
    async def forget(body: TaskBody) -> dict:
        await asyncio.to_thread(engine.forget, body.task_id)
        return {"task_id": body.task_id, "forgotten": True}

    @app.get("/tiderl/usage")
    async def usage() -> dict:
        return asdict(await asyncio.to_thread(engine.token_usage))

    @app.post("/tiderl/update_weights")
    async def update_weights(body: UpdateWeightsBody) -> dict:
        state = await asyncio.to_thread(_read_weights, body.path)
        try:
            await asyncio.to_thread(engine.update_weights, state, body.version)
        except (KeyError, RuntimeError) as exc:  # mismatched
            raise ValueError(f"update_weights: {exc}") from exc
        return {"version": engine.version}

    @app.post("/tiderl/sleep")
    async def sleep() -> dict:
        await asyncio.to_thread(engine.sleep)
        return {"asleep": True}

    @app.post("/tiderl/wake_up")
    async def wake_up(body: UpdateWeightsBody) -> dict:
        state = await asyncio.to_thread(_read_weights, body.path)
        await asyncio.to_thread(engine.wake_up, state, body.version)
        return {"asleep": False, "version": engine.version}

    @app.post("/tiderl/flush")
    async def flush() -> dict:
        await asyncio.to_thread(engine.flush)
        return {"flushed": True}

    return app


def _read_weights(path: str) -> dict:
    from tiderl.models.folder import ModelLoadError, load_state_dict  # late: torch

    try:
        return load_state_dict(path)
    except OSError as exc:  # unreadable, or a name the system refuses (too long)
        raise ValueError(f"path {cut(path)}: {exc.strerror or exc}") from exc
    except (ModelLoadError, RuntimeError) as exc:  # not a weights folder
        raise ValueError(f"path {cut(path)}: {exc}") from exc


def _completion_response(out: Any, body: CompletionRequest, model_name: str,
                         tokenizer: Tokenizer | None) -> dict:
    text = tokenizer.decode(out.output_ids) if tokenizer is not None else ""
    logprobs = None
    if body.logprobs is not None:
        logprobs = {"token_logprobs": list(out.logprobs), "tokens": None, "top_logprobs": None,
                    "text_offset": None}
    num_output = len(out.output_ids)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model or model_name,
        "task_id": out.task_id,
        "version": out.version,
        "choices": [{"index": 0, "text": text, "token_ids": list(out.output_ids),
                     "logprobs": logprobs, "finish_reason": out.finish_reason}],
        "usage": {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": num_output,
                  "total_tokens": out.num_prompt_tokens + num_output,
                  "cached_tokens": out.num_cached_tokens,
                  "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}},
    }


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:3]:
            if err.get("type") == "json_invalid":
                parts.append(f"malformed JSON: {err.get('ctx', {}).get('error', 'invalid')}")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where or 'body'}: {err.get('msg', 'invalid')}")
        return error_response(422, "; ".join(parts) or "invalid request",
                              "invalid_request_error")

    @app.exception_handler(NotReady)
    async def not_ready(_: Request, exc: NotReady) -> JSONResponse:
        return error_response(503, str(exc), "asleep", headers=RETRY_AFTER)

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(ImagesMissing)
    async def images_missing(_: Request, exc: ImagesMissing) -> JSONResponse:
        return error_response(409, str(exc), "image_missing", keys=list(exc.keys))

    @app.exception_handler(PinRefused)
    async def pin_refused(_: Request, exc: PinRefused) -> JSONResponse:
        return error_response(409, str(exc), "pin_refused")

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        """Unknown routes, wrong methods, unparsable bodies: the same one-line format."""
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"{type(exc).__name__}: {exc}", "internal_error")
