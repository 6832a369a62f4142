"""One client interface to a rollout engine, four backends.

    EngineClient ─┬─ EmbeddedClient     in-process LLMEngine
                  ├─ TideRLHTTPClient   our server (tiderl/engine/server.py)
                  ├─ VLLMClient         vLLM: /v1/completions with token ids, vllm:* metrics
                  └─ SGLangClient       SGLang: /generate with input_ids (and image_data),
                                        sglang:* metrics

vLLM and SGLang cannot pin a task's KV; with them CTB works through admission alone (keeping the
sum of active footprints within the budget keeps their prefixes resident). Calls a backend does
not have raise :class:`NotSupported`; ``forget`` (a task ended: drop its state) is a no-op where
the engine keeps none. A pin the engine refuses (too little KV left beside the pins; our server
answers 409) raises :class:`PinRefused`. Request bodies and response parsing are pure functions.

``TideRLHTTPClient`` sends the admin token (``Authorization: Bearer``) of :mod:`tiderl.auth`:
its ``admin_token`` argument, else ``TIDERL_ADMIN_TOKEN``, else the job's. vLLM has an
equivalent (``--api-key``, checked on its ``/v1`` routes); the launcher does not set it (its
servers listen on the loopback only).
"""

from __future__ import annotations

import abc
import asyncio
import base64
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import httpx

from tiderl.auth import ADMIN, bearer_headers, resolve_token
from tiderl.core.quote import short
from tiderl.core.types import ImageRef
from tiderl.engine.client_metrics import (
    ClientMetrics,
    hit_rate,
    metrics_from_prometheus,
    per_second,
    vllm_kv_capacity,
)
from tiderl.engine.config import SERVED_MODEL_NAME, VLLM_NO_IMAGES
from tiderl.engine.kv_cache_manager import PinRefused
from tiderl.engine.metric_names import (
    FRACTIONS,
    SGLANG_NAMINGS,
    SGLANG_PRIORITY,
    TIDERL_NAMINGS,
    VLLM_NAMINGS,
    MetricNames,
)
from tiderl.engine.prometheus import parse_prometheus
from tiderl.engine.request import Images, SamplingParams
from tiderl.env.images import png_data_url

if TYPE_CHECKING:
    from tiderl.engine.kv_cache_manager import TokenUsage
    from tiderl.engine.llm_engine import LLMEngine


class NotSupported(Exception):
    """The backend has no such call."""


def image_body(ref: ImageRef, png: bytes | None) -> dict[str, Any]:
    """An image of a completion request to ``tiderl engine serve`` (``png`` None: by its key
    alone)."""
    body = {"key": ref.key, "offset": ref.offset, "num_tokens": ref.num_tokens,
            "grid": list(ref.grid)}
    return body if png is None else body | {"png": base64.b64encode(png).decode()}


class EngineRequestError(ValueError):
    """The server refused the request (4xx); the message is the server's."""


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One turn, the same fields for every backend (``version`` None where unknown)."""

    task_id: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    version: int | None = None


class EngineClient(abc.ABC):
    @abc.abstractmethod
    async def generate(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, images: Images = ()) -> GenerateResult:
        """One turn. ``priority``: lower runs first where the engine schedules by priority
        (vLLM, SGLang as the launcher starts them); ours schedules first come, first served.
        ``images``: the images among ``prompt_ids`` (their placeholder tokens) with their PNG
        bytes, for a model that reads images."""

    async def pin(self, task_id: str) -> int:
        """Keep the task's cached context resident; returns the pinned tokens."""
        raise self._no_pins("pin")

    async def unpin(self, task_id: str) -> None:
        raise self._no_pins("unpin")

    async def forget(self, task_id: str) -> None:
        """The task ended: drop its pin and whatever the engine keeps for it (nothing to drop
        on vLLM and SGLang, which keep no per-task state)."""
        return None

    def _no_pins(self, call: str) -> NotSupported:
        return NotSupported(f"{type(self).__name__}: {call} is not supported by this backend "
                            "(CTB keeps prefixes resident through admission alone)")

    async def token_usage(self) -> TokenUsage:
        raise NotSupported(f"{type(self).__name__}: token_usage is not supported; "
                           "use metrics().kv_cache_usage_perc")

    @property
    def supports_pins(self) -> bool:
        """Whether ``pin`` keeps a task's KV (else CTB works through admission alone)."""
        return type(self).pin is not EngineClient.pin

    @abc.abstractmethod
    async def update_weights(self, weights: Any, version: int) -> None:
        """``weights``: a safetensors folder path, or (in-process only) a state dict."""

    async def sleep(self) -> None:
        """Free the engine's weights and KV cache (its rank went to the trainer)."""
        raise NotSupported(f"{type(self).__name__}: sleep is not supported by this backend")

    async def wake_up(self, weights: Any, version: int) -> None:
        """Allocate them again and serve ``weights`` (a folder path) as ``version``."""
        raise NotSupported(f"{type(self).__name__}: wake_up is not supported by this backend")

    @abc.abstractmethod
    async def flush(self) -> None: ...

    @abc.abstractmethod
    async def metrics(self) -> ClientMetrics: ...

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# -- in-process ----------------------------------------------------------------------------------

class EmbeddedClient(EngineClient):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    async def generate(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, images: Images = ()) -> GenerateResult:
        out = await self.engine.generate(task_id, prompt_ids, sampling, images)
        return GenerateResult(out.task_id, list(out.output_ids), list(out.logprobs),
                              str(out.finish_reason), out.num_prompt_tokens,
                              out.num_cached_tokens, out.version)

    # Pins take the engine's lock, which a step holds for its whole duration: in a thread, as
    # the HTTP server does, they leave the event loop (every other task's turn) running.
    async def pin(self, task_id: str) -> int:
        return await asyncio.to_thread(self.engine.pin, task_id)

    async def unpin(self, task_id: str) -> None:
        await asyncio.to_thread(self.engine.unpin, task_id)

    async def forget(self, task_id: str) -> None:
        await asyncio.to_thread(self.engine.forget, task_id)

    async def token_usage(self) -> TokenUsage:
        return self.engine.token_usage()

    async def update_weights(self, weights: Any, version: int) -> None:
        if isinstance(weights, str | bytes) or hasattr(weights, "__fspath__"):
            from tiderl.models.folder import load_state_dict

            weights = load_state_dict(weights)
        self.engine.update_weights(weights, version)

    async def flush(self) -> None:
        self.engine.flush()

    async def metrics(self) -> ClientMetrics:
        m = self.engine.metrics()
        return ClientMetrics(m.prefix_cache_queries, m.prefix_cache_hits, m.kv_cache_usage_perc,
                             m.num_requests_running, m.num_requests_waiting, m.num_preemptions,
                             hit_rate(m.prefix_cache_hits, m.prefix_cache_queries),
                             prefill_tokens_per_s=per_second(m.prompt_tokens_computed,
                                                             m.prefill_s))

    async def close(self) -> None:
        await self.engine.close()


# -- HTTP base -----------------------------------------------------------------------------------

class _HTTPClient(EngineClient):
    metric_names: tuple[MetricNames, ...] = ()  # the backend's, newest naming first

    def __init__(self, base_url: str, timeout: float = 600.0,
                 http: httpx.AsyncClient | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http or httpx.AsyncClient(base_url=self.base_url, timeout=timeout,
                                              headers=headers)

    async def _post(self, path: str, body: dict | None = None) -> dict:
        return _json_or_raise(await self.http.post(path, json=body or {}))

    async def is_up(self) -> bool:
        """Whether the server answers ``/health`` with 200 (False while it starts)."""
        try:
            return (await self.http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def metrics(self) -> ClientMetrics:
        response = await self.http.get("/metrics")
        _json_or_raise(response, parse=False)
        try:
            return self._metrics_of(response.text)
        except ValueError as exc:
            raise RuntimeError(f"GET /metrics: {exc}") from None

    def _metrics_of(self, text: str) -> ClientMetrics:
        """A ``/metrics`` page as ClientMetrics (a backend adds what its names leave out)."""
        values = parse_prometheus(text, FRACTIONS, keep=self._is_counted)
        return metrics_from_prometheus(values, self.metric_names)

    @staticmethod
    def _is_counted(labels: dict[str, str]) -> bool:
        """Whether a sample with these labels counts toward its name's value."""
        return True

    async def close(self) -> None:
        await self.http.aclose()


def _error_message(response: httpx.Response) -> str:
    """An error body's message on one line: ``{"error": {"message"}}`` (ours, vLLM's, a request
    SGLang refused), ``{"error": "..."}`` (SGLang's schema check) or ``{"message"}`` (SGLang's
    validation errors and failed weight updates); else the body's start."""
    try:
        data = response.json()
        error = data.get("error", data)
        message = error if isinstance(error, str) else error["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = response.text[:200]
    return " ".join(str(message).split())


def _json_or_raise(response: httpx.Response, parse: bool = True) -> dict:
    if response.status_code >= 400:
        message = _error_message(response)
        error = EngineRequestError if response.status_code < 500 else RuntimeError
        raise error(f"{response.request.method} {response.request.url.path}: "
                    f"{response.status_code}: {message}")
    return response.json() if parse else {}


# -- TideRL server -------------------------------------------------------------------------------

SENT_IMAGES = 4096  # image keys a TideRLHTTPClient remembers having sent the bytes of


def _missing_images(response: httpx.Response) -> set[str]:
    """The keys of a 409 ``image_missing`` (images the server no longer holds), else none."""
    if response.status_code != 409:
        return set()
    try:
        error = response.json()["error"]
        return set(error["keys"]) if error.get("type") == "image_missing" else set()
    except (ValueError, KeyError, TypeError):
        return set()


class TideRLHTTPClient(_HTTPClient):
    metric_names = TIDERL_NAMINGS

    def __init__(self, base_url: str, timeout: float = 600.0,
                 http: httpx.AsyncClient | None = None,
                 admin_token: str | None = None) -> None:
        super().__init__(base_url, timeout, http,
                         bearer_headers(resolve_token(ADMIN, admin_token)))
        self._sent: OrderedDict[str, None] = OrderedDict()  # image keys sent with bytes

    async def generate(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, images: Images = ()) -> GenerateResult:
        """Images the server was sent before go by their key alone; those it no longer holds
        (409 ``image_missing``) go again with their bytes."""
        body = completion_body(prompt_ids, sampling) | {"task_id": task_id}
        if not images:
            return parse_completion(task_id, await self._post("/v1/completions", body))
        held = {ref.key for ref, _ in images if ref.key in self._sent}
        for attempt in range(2):
            body["images"] = [image_body(ref, None if ref.key in held else png)
                              for ref, png in images]
            response = await self.http.post("/v1/completions", json=body)
            missing = _missing_images(response)
            if not missing or attempt:
                break
            held -= missing  # evicted there since: once more, with their bytes
        data = _json_or_raise(response)
        for ref, _ in images:  # the last ``SENT_IMAGES`` keys sent with their bytes
            self._sent[ref.key] = None
            self._sent.move_to_end(ref.key)
        while len(self._sent) > SENT_IMAGES:
            self._sent.popitem(last=False)
        return parse_completion(task_id, data)

    async def pin(self, task_id: str) -> int:
        response = await self.http.post("/tiderl/pin", json={"task_id": task_id})
        if response.status_code == 409:
            raise PinRefused(_error_message(response))
        return int(_json_or_raise(response)["num_pinned_tokens"])

    async def unpin(self, task_id: str) -> None:
        await self._post("/tiderl/unpin", {"task_id": task_id})

    async def forget(self, task_id: str) -> None:
        await self._post("/tiderl/forget", {"task_id": task_id})

    async def token_usage(self) -> TokenUsage:
        from tiderl.engine.kv_cache_manager import TokenUsage

        response = await self.http.get("/tiderl/usage")
        return TokenUsage(**_json_or_raise(response))

    async def update_weights(self, weights: Any, version: int) -> None:
        if isinstance(weights, dict):
            raise NotSupported("TideRLHTTPClient.update_weights: pass a safetensors folder "
                               "path (state dicts are not sent over HTTP)")
        await self._post("/tiderl/update_weights", {"path": str(weights), "version": version})

    async def flush(self) -> None:
        await self._post("/tiderl/flush")

    async def sleep(self) -> None:
        await self._post("/tiderl/sleep")

    async def wake_up(self, weights: Any, version: int) -> None:
        await self._post("/tiderl/wake_up", {"path": str(weights), "version": version})


# -- vLLM ----------------------------------------------------------------------------------------

class VLLMClient(_HTTPClient):
    """vLLM's OpenAI server (0.34; every route checked against a real 0.34.0 server on the CPU,
    tests/integration/test_vllm_server.py). Everything but generation and metrics needs
    ``VLLM_SERVER_DEV_MODE=1``: weights are reloaded from a folder by ``/collective_rpc``
    ``reload_weights``, then tagged by ``/update_weight_version`` (completions report it);
    ``flush_on_update`` also resets the prefix cache (the reload keeps it). Sleep is level 2
    (weights and KV discarded; ``--enable-sleep-mode``)."""

    metric_names = VLLM_NAMINGS

    def __init__(self, base_url: str, model: str, timeout: float = 600.0,
                 http: httpx.AsyncClient | None = None, flush_on_update: bool = True) -> None:
        super().__init__(base_url, timeout, http)
        self.model = model
        self.flush_on_update = flush_on_update

    async def generate(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, images: Images = ()) -> GenerateResult:
        if images:
            raise NotSupported(VLLM_NO_IMAGES)
        body = completion_body(prompt_ids, sampling) | {
            "model": self.model, "return_token_ids": True, "return_weight_versions": True}
        if priority:
            body["priority"] = priority
        return parse_completion(task_id, await self._post("/v1/completions", body))

    async def update_weights(self, weights: Any, version: int) -> None:
        if isinstance(weights, dict):
            raise NotSupported("VLLMClient.update_weights: pass a checkpoint folder path")
        # paused (requests in flight keep their place): no token is sampled between the
        # reload and its version tag, and none from the old KV after the flush
        _json_or_raise(await self.http.post("/pause", params={"mode": "keep"}))
        try:
            await self._post("/collective_rpc", {"method": "reload_weights",
                                                 "kwargs": {"weights_path": str(weights)}})
            await self._post("/update_weight_version", {"new_version": str(version)})
            if self.flush_on_update:
                await self.flush()
        finally:
            _json_or_raise(await self.http.post("/resume"))

    async def flush(self) -> None:
        """Reset the prefix cache. vLLM refuses while requests hold blocks, unless it may
        preempt them (``reset_running_requests``: they recompute their KV), and in a job
        some always run."""
        response = await self.http.post("/reset_prefix_cache",
                                        params={"reset_running_requests": "true"})
        if _json_or_raise(response).get("success") is False:
            raise RuntimeError("vLLM /reset_prefix_cache: the cache was not reset")

    async def sleep(self) -> None:
        _json_or_raise(await self.http.post("/sleep", params={"level": 2, "mode": "wait"}))

    async def wake_up(self, weights: Any, version: int) -> None:
        _json_or_raise(await self.http.post("/wake_up"))
        await self.update_weights(weights, version)  # level 2 discarded them

    def _metrics_of(self, text: str) -> ClientMetrics:
        return replace(super()._metrics_of(text), kv_capacity_tokens=vllm_kv_capacity(text))


def completion_body(prompt_ids: list[int], sampling: SamplingParams) -> dict:
    """An OpenAI /v1/completions body with a token-id prompt (vLLM and TideRL)."""
    body: dict[str, Any] = {"prompt": list(prompt_ids), "max_tokens": sampling.max_tokens,
                            "temperature": sampling.temperature, "top_p": sampling.top_p,
                            "logprobs": 1}
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    return body


def parse_completion(task_id: str, data: dict) -> GenerateResult:
    """A /v1/completions response: ``choices[0].token_ids`` (vLLM ``return_token_ids``, or
    TideRL), else the ``token_id:N`` strings of ``logprobs.tokens``
    (vLLM ``--return-tokens-as-token-ids``)."""
    choice = data["choices"][0]
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        tokens = logprobs.get("tokens") or []
        if not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            raise ValueError("completion response has no token ids (vLLM: send "
                             "return_token_ids or start it with --return-tokens-as-token-ids)")
        ids = [int(t.split(":", 1)[1]) for t in tokens]
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = usage.get("cached_tokens", details.get("cached_tokens")) or 0
    version = data.get("version")  # TideRL; vLLM: the span of the first output token
    spans = choice.get("weight_versions") or []
    if version is None and spans:
        version = _int_or_none(spans[0].get("version"))
    return GenerateResult(task_id, [int(i) for i in ids],
                          [float(x) for x in logprobs.get("token_logprobs") or []],
                          choice.get("finish_reason") or "", int(usage.get("prompt_tokens", 0)),
                          int(cached), version)


# -- SGLang --------------------------------------------------------------------------------------

class SGLangClient(_HTTPClient):
    """SGLang's native server (0.5.23; ``--enable-metrics`` for ``metrics()``,
    ``--enable-memory-saver`` for sleep: its weights and KV released, then resumed and
    reloaded from a folder; ``--schedule-low-priority-values-first`` for vLLM's priority
    order)."""

    metric_names = SGLANG_NAMINGS

    def __init__(self, base_url: str, timeout: float = 600.0,
                 http: httpx.AsyncClient | None = None, flush_on_update: bool = True) -> None:
        super().__init__(base_url, timeout, http)
        self.flush_on_update = flush_on_update

    async def generate(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, images: Images = ()) -> GenerateResult:
        body = sglang_generate_body(prompt_ids, sampling, images)
        if priority:
            body["priority"] = priority
        return parse_sglang_generate(task_id, prompt_ids, await self._post("/generate", body))

    async def update_weights(self, weights: Any, version: int) -> None:
        if isinstance(weights, dict):
            raise NotSupported("SGLangClient.update_weights: pass a checkpoint folder path")
        data = await self._post("/update_weights_from_disk",
                                {"model_path": str(weights), "weight_version": str(version),
                                 "flush_cache": self.flush_on_update})
        if not data.get("success", False):
            raise RuntimeError(f"SGLang update_weights_from_disk: {data.get('message')}")

    async def flush(self) -> None:
        """Answered with text, not JSON; a 400 while requests run or wait."""
        _json_or_raise(await self.http.post("/flush_cache"), parse=False)

    async def sleep(self) -> None:
        await self._post("/release_memory_occupation")  # needs an idle server: it is here

    async def wake_up(self, weights: Any, version: int) -> None:
        await self._post("/resume_memory_occupation")
        await self.update_weights(weights, version)  # the released weights are gone

    @staticmethod
    def _is_counted(labels: dict[str, str]) -> bool:
        """With priority scheduling SGLang exports each count once per priority level beside
        the total (``priority=""``): the levels are left out of the sums."""
        return not labels.get(SGLANG_PRIORITY)


def sglang_generate_body(prompt_ids: list[int], sampling: SamplingParams,
                         images: Images = ()) -> dict:
    """A /generate body. ``images``: ``image_data``, one PNG data URL per image in the order
    of their placeholder runs in ``prompt_ids``, which hold each run expanded (vision_start,
    one image-pad per LLM token of the image, vision_end), as an HF processor writes them:
    SGLang's Qwen2-VL processor resizes each image itself (the same ``smart_resize``), finds
    the runs in the ids, and derives the multimodal positions from them."""
    params: dict[str, Any] = {"max_new_tokens": sampling.max_tokens,
                              "temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    body = {"input_ids": list(prompt_ids), "sampling_params": params, "return_logprob": True}
    if images:
        ordered = sorted(images, key=lambda image: image[0].offset)
        body["image_data"] = [png_data_url(png) for _, png in ordered]
    return body


def parse_sglang_generate(task_id: str, prompt_ids: list[int], data: dict) -> GenerateResult:
    """``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text]``."""
    meta = data["meta_info"]
    entries = meta.get("output_token_logprobs") or []
    ids = data.get("output_ids")
    if ids is None:
        ids = [entry[1] for entry in entries]
    finish = meta.get("finish_reason")
    reason = finish.get("type", "") if isinstance(finish, dict) else str(finish or "")
    return GenerateResult(task_id, [int(i) for i in ids], [float(e[0]) for e in entries],
                          reason, int(meta.get("prompt_tokens", len(prompt_ids))),
                          int(meta.get("cached_tokens", 0)),
                          _int_or_none(meta.get("weight_version")))


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int) or str(value).isdigit() else None


# -- by backend ----------------------------------------------------------------------------------

def server_client(backend: str, base_url: str, timeout: float = 600.0,
                  flush_on_update: bool = True, admin_token: str | None = None) -> _HTTPClient:
    """The client of one ``engine.backend`` server at ``base_url`` (``flush_on_update``:
    ``engine.kv_on_update`` flush; our server applies it itself; ``admin_token``: ours, None
    for the environment's or the job's, see :mod:`tiderl.auth`)."""
    if backend == "http":
        return TideRLHTTPClient(base_url, timeout, admin_token=admin_token)
    if backend == "vllm":
        return VLLMClient(base_url, SERVED_MODEL_NAME, timeout, flush_on_update=flush_on_update)
    if backend == "sglang":
        return SGLangClient(base_url, timeout, flush_on_update=flush_on_update)
    raise ValueError(f"engine.backend {short(backend)} has no server")
