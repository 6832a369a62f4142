"""HTTP server of the embedded engine: OpenAI-compatible token-id completions, Prometheus
metrics and admin routes.

    client ──POST /v1/completions──> build_app ──engine.generate()──> LLMEngine (step loop)
           ──GET /metrics──────────> EngineCollector ──engine.metrics()── (read on each scrape)
           ──/tiderl/{pin,unpin,usage,update_weights,flush}──> engine admin calls
           ──/tiderl/{sleep,wake_up}──> free / reload the weights and the KV cache (ERS moves)

Bad input (malformed JSON, wrong types, an empty prompt, token ids outside the vocabulary, a
prompt longer than the context) is answered 400 or 422 with ``{"error": {"message", "type"}}``;
the server keeps serving.
"""

from __future__ import annotations

import asyncio
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

from tiderl.engine.request import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from tiderl.engine.llm_engine import LLMEngine

PREFIX = "tiderl:"


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
    task_id: str | None = None  # TideRL extra: the task whose KV a pin keeps
    stream: bool = False  # accepted only as False
    n: int = 1  # accepted only as 1


class TaskBody(BaseModel):
    task_id: str = Field(min_length=1)


class UpdateWeightsBody(BaseModel):
    path: str = Field(min_length=1)  # a folder of *.safetensors (HF names)
    version: int


class EngineCollector:
    """Reads ``engine.metrics()`` at scrape time; counters gain ``_total`` on exposition."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        m = self.engine.metrics()
        counters = (
            ("prefix_cache_queries", m.prefix_cache_queries, "Prompt tokens looked up."),
            ("prefix_cache_hits", m.prefix_cache_hits, "Prompt tokens found in the cache."),
            ("num_preemptions", m.num_preemptions, "Requests preempted (recompute)."),
            ("prompt_tokens_computed", m.prompt_tokens_computed, "Prompt tokens prefilled."),
            ("decode_tokens", m.decode_tokens, "Tokens sampled."),
            ("pins", m.num_pins, "Pins taken (a task's context held between its turns)."),
        )
        for name, value, doc in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        gauges = (
            ("kv_cache_usage_perc", m.kv_cache_usage_perc, "Fraction of KV blocks referenced."),
            ("num_requests_running", m.num_requests_running, "Requests running."),
            ("num_requests_waiting", m.num_requests_waiting, "Requests waiting."),
            ("weight_version", self.engine.version, "Version of the loaded weights."),
        )
        for name, value, doc in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)


# -- app -----------------------------------------------------------------------------------------

def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


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


def build_app(engine: LLMEngine, tokenizer: Tokenizer | None = None,
              model_name: str = "tiderl") -> FastAPI:
    """The server's routes over one engine; each app has its own Prometheus registry."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.close()

    app = FastAPI(title="TideRL engine", lifespan=lifespan)
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
        out = await engine.generate(task_id, list(body.prompt), sampling)
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
    from tiderl.models.loading import ModelLoadError, load_state_dict  # late: torch

    try:
        return load_state_dict(path)
    except (ModelLoadError, OSError, RuntimeError) as exc:  # unreadable
        raise ValueError(f"weights {path}: {exc}") from exc


def serve(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000,
          tokenizer: Tokenizer | None = None, model_name: str = "tiderl") -> None:
    """Run the app with uvicorn until interrupted (blocks)."""
    import uvicorn

    uvicorn.run(build_app(engine, tokenizer, model_name), host=host, port=port,
                log_level="warning")


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

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"{type(exc).__name__}: {exc}", "internal_error")
