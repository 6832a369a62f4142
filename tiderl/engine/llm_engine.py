"""The embedded rollout engine: scheduler + model runner behind an async ``generate``.

    generate() ──add_request──> Scheduler.waiting          (event-loop thread, under the lock)
                                     │
    step loop (asyncio task) ── await step() in the model thread ──> finished requests
                                     │                                    │
        step() = schedule() → ModelRunner.execute() → update()           └─> resolve futures

One background asyncio task (started by the first ``generate``) runs ``step`` in a single model
thread while there is unfinished work and sleeps on an event otherwise. A lock serialises steps
with every call that touches the scheduler or the weights (pin, unpin, forget, flush,
update_weights), so those always apply between two steps.

Context length, as vLLM: a prompt must leave room for one output token within the model's
``max_position_embeddings`` (else ValueError), and ``max_tokens`` is cut to what is left, so no
request runs past it. Per-task state (a remembered context, a pin) lives until ``forget`` (the
task ended) or ``flush``, and is bounded by the KV pool's block count either way.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from tiderl.engine.config import EngineConfig
from tiderl.engine.kv_cache_manager import TokenUsage
from tiderl.engine.model_runner import ModelRunner
from tiderl.engine.multimodal import ImageEncoder
from tiderl.engine.request import Images, Request, SamplingParams
from tiderl.engine.scheduler import Scheduler, SchedulerOutput
from tiderl.models.config import ModelConfig
from tiderl.models.loading import model_from_config
from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.models.qwen2_vl import VISION_PREFIX, Qwen2VLForCausalLM
from tiderl.models.vision_inputs import image_settings


class EngineAsleepError(ValueError):
    """A call that needs the weights while the engine sleeps."""


class EngineBusyError(ValueError):
    """Sleep was asked while requests are in flight."""


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    task_id: str
    output_ids: list[int]
    logprobs: list[float]  # of each output token under its sampling distribution (sampler.py)
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit tokens at admission
    version: int  # weights version when the first output token was sampled


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    kv_cache_usage_perc: float  # 0..1
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions: int
    prompt_tokens_computed: int  # prompt positions computed (prefills and recomputes)
    decode_tokens: int  # output tokens sampled
    prefill_s: float = 0.0  # step time spent on prompt positions (each step's by token share)
    num_pins: int = 0  # pins taken
    num_tasks: int = 0  # tasks with per-task state (a remembered context or a pin)
    num_pins_released: int = 0  # pins dropped so that a request could fit


class LLMEngine:
    def __init__(self, model: Qwen2ForCausalLM | Qwen2VLForCausalLM,
                 engine_config: EngineConfig, eos_token_id: int | Collection[int] | None,
                 version: int = 0, model_folder: str | None = None) -> None:
        """``eos_token_id``: the token, or the set of tokens, that ends a generation (an HF
        folder's config.json and generation_config.json may each name several).
        ``model_folder``: where a model that reads images keeps its image settings
        (preprocessor_config.json; the model's patch sizes and the default pixel budget
        without one)."""
        if not isinstance(model, Qwen2ForCausalLM | Qwen2VLForCausalLM):
            raise ValueError(f"the embedded engine runs Qwen2 and Qwen2-VL, not "
                             f"{type(model).__name__}: a model of another architecture rolls "
                             "out on vLLM or SGLang")
        self.images = ImageEncoder(model, image_settings(model_folder, model.config)) \
            if isinstance(model, Qwen2VLForCausalLM) else None
        self.config = engine_config
        self.model = model
        self.version = version
        self.vocab_size = model.config.vocab_size
        self.max_model_len = model.config.max_position_embeddings
        self.scheduler = Scheduler(engine_config, eos_token_id)
        self.runner = ModelRunner(model, self.scheduler.kv_cache.pool.num_blocks,
                                  engine_config.block_size, kernels=engine_config.kernels)
        self.prompt_tokens_computed = 0
        self.decode_tokens = 0
        self.prefill_s = 0.0
        self._versions: dict[str, int] = {}  # request id -> version of its first output token
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._futures: dict[str, asyncio.Future[Request]] = {}
        self._withdrawn: set[str] = set()  # cancelled before their thread queued them
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._asleep = False
        self._shapes: dict[str, tuple[torch.nn.Parameter, torch.Size]] = {}  # while asleep

    @classmethod
    def from_configs(cls, model_config: ModelConfig, engine_config: EngineConfig) -> LLMEngine:
        model, _ = model_from_config(model_config)
        return cls(model, engine_config, model.config.eos_token_id)

    # -- one step --------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One ``schedule()`` → ``execute()`` → ``update()``; returns the requests it finished."""
        with self._lock:
            output = self.scheduler.schedule()
            prompt_tokens = self._count(output)
            started = time.perf_counter()
            result = self.runner.execute(output)
            if prompt_tokens:  # the step's time, shared by its positions
                self.prefill_s += (time.perf_counter() - started) * prompt_tokens / max(
                    1, output.num_batched_tokens)
            return self.scheduler.update(result)

    def _count(self, output: SchedulerOutput) -> int:
        """Count the step's positions; returns its prompt positions."""
        requests = self.scheduler.requests
        prompt_tokens = 0
        for item in output.scheduled:
            request = requests[item.request_id]
            start, end = item.num_computed_tokens, item.num_computed_tokens + len(item.token_ids)
            prompt_tokens += max(0, min(end, request.num_prompt_tokens) - start)
            if item.samples:
                self.decode_tokens += 1
                if item.num_output_tokens == 0:
                    self._versions[item.request_id] = self.version
        self.prompt_tokens_computed += prompt_tokens
        return prompt_tokens

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    images: Images = ()) -> Request:
        """Validate and queue one turn (the synchronous half of ``generate``); ``max_tokens``
        is cut to the context left after the prompt."""
        request = self._new_request(task_id, prompt_ids, sampling, images)
        self._enqueue(request, images)
        return request

    def _new_request(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     images: Images = ()) -> Request:
        self._validate(prompt_ids, sampling)
        if images and self.images is None:
            raise ValueError(f"images: this engine's model ({type(self.model).__name__}) "
                             "reads no images")
        room = self.max_model_len - len(prompt_ids)
        if sampling.max_tokens > room:
            sampling = replace(sampling, max_tokens=room)
        self._validate_kv(prompt_ids, sampling)
        return Request(f"{task_id}#{next(self._ids)}", task_id, list(prompt_ids), sampling)

    def _enqueue(self, request: Request, images: Images = ()) -> None:
        """Queue the request; a model that reads images first encodes the images it has not
        cached (the vision tower runs here, between two steps)."""
        with self._lock:
            if request.request_id in self._withdrawn:  # its caller was cancelled first
                self._withdrawn.discard(request.request_id)
                return
            if self._asleep:
                raise EngineAsleepError("the engine is asleep: wake_up loads weights first")
            if self.images is not None:
                request.images = self.images.prompt(request.prompt_token_ids, images)
            self.scheduler.add_request(request)

    async def generate(self, task_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       images: Images = ()) -> GenerateOutput:
        """Queue the turn and wait for it. The engine lock is taken off the event loop (a step
        holds it for its whole forward); the future is registered before the request reaches
        the scheduler, so a step that finishes it at once still finds it."""
        request = self._new_request(task_id, prompt_ids, sampling, images)
        future = asyncio.get_running_loop().create_future()
        self._futures[request.request_id] = future
        try:
            await asyncio.to_thread(self._enqueue, request, images)
            self._start_loop()
            await future
        except asyncio.CancelledError:
            with self._lock:  # queued: abort it; not yet (its thread still runs): withdraw it
                if self.scheduler.abort_request(request.request_id) is None \
                        and request.finish_reason is None:
                    self._withdrawn.add(request.request_id)
            self._versions.pop(request.request_id, None)
            raise
        finally:
            self._futures.pop(request.request_id, None)
        return self._output(request)

    def _output(self, request: Request) -> GenerateOutput:
        version = self._versions.pop(request.request_id, self.version)
        reason = request.finish_reason.value if request.finish_reason else "abort"
        return GenerateOutput(request.task_id, list(request.output_token_ids),
                              list(request.output_logprobs), reason, request.num_prompt_tokens,
                              request.num_cached_tokens, version)

    def _validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        if not prompt_ids:
            raise ValueError("prompt_ids: empty prompt")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: token ids outside the vocabulary [0, "
                             f"{self.vocab_size}): {bad[:5]}")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens, longer than max_model_len "
                             f"{self.max_model_len}")
        if len(prompt_ids) == self.max_model_len:
            raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens fill max_model_len: no "
                             "room for an output token")
        bad = [t for t in sampling.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: outside the vocabulary: {bad[:5]}")

    def _validate_kv(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        total = len(prompt_ids) + sampling.max_tokens
        if total > self.config.kv_cache_tokens:
            raise ValueError(f"prompt + max_tokens = {total} tokens, more than the KV pool "
                             f"holds ({self.config.kv_cache_tokens})")

    # -- the step loop ---------------------------------------------------------------------------

    def _start_loop(self) -> None:
        task, loop = self._loop_task, asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:  # none yet, or dead
            self._wake = asyncio.Event()
            self._executor = self._executor or ThreadPoolExecutor(1, "tiderl-model")
            self._loop_task = loop.create_task(self._run())
        assert self._wake is not None
        self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self.scheduler.has_unfinished:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                finished = await loop.run_in_executor(self._executor, self.step)
            except Exception as exc:  # a failing step fails every waiting caller
                self._fail_all(exc)
                continue
            for request in finished:
                future = self._futures.get(request.request_id)
                if future is not None and not future.done():
                    future.set_result(request)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            for request_id, future in list(self._futures.items()):
                self.scheduler.abort_request(request_id)
                if not future.done():
                    future.set_exception(exc)

    async def close(self) -> None:
        """Stop the step loop; pending ``generate`` calls are cancelled."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for future in list(self._futures.values()):
            future.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- pins, cache, weights --------------------------------------------------------------------

    def pin(self, task_id: str) -> int:
        """Pin the task's cached context; returns the pinned tokens (whole blocks).
        :class:`~tiderl.engine.kv_cache_manager.PinRefused` when it would leave too little of
        the pool for the largest request in the engine (see ``Scheduler.pin``)."""
        with self._lock:
            return self.scheduler.pin(task_id) * self.config.block_size

    def unpin(self, task_id: str) -> None:
        with self._lock:
            self.scheduler.kv_cache.unpin(task_id)

    def forget(self, task_id: str) -> None:
        """The task ended: drop its pin and its remembered context."""
        with self._lock:
            self.scheduler.kv_cache.forget_task(task_id)

    def token_usage(self) -> TokenUsage:
        with self._lock:
            return self.scheduler.kv_cache.token_usage()

    def flush(self) -> None:
        """Drop every cached, unreferenced block (held and pinned blocks stay) and every
        unpinned task's remembered context."""
        with self._lock:
            self.scheduler.kv_cache.flush()

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load weights (HF names, any subset; cast to the model's dtype) and set ``version``.
        With ``kv_on_update: flush`` (the default) the prefix cache is reset: no KV computed
        with the old weights is hit again; with ``keep`` pinned and cached prefixes stay
        hit-able. Requests in flight continue on their already-computed KV."""
        if self._asleep:
            raise EngineAsleepError("update_weights: the engine is asleep (wake_up takes the "
                                    "weights)")
        self._load(state_dict, version)

    def _load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        params = self.model.state_dict(keep_vars=True)  # tied lm_head included
        unknown = [k for k in state_dict if k not in params]
        if unknown:
            raise ValueError(f"update_weights: unknown parameters {unknown[:3]}")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
        with self._lock, torch.no_grad():
            if self.images is not None and _changes_tower(params, state_dict):
                self.images.forget()  # embeddings of the old tower
            for name, tensor in state_dict.items():
                params[name].copy_(tensor)
            if self.config.kv_on_update == "flush":
                self.scheduler.kv_cache.reset_prefix_cache()
            self.version = version

    # -- sleep -----------------------------------------------------------------------------------

    @property
    def is_asleep(self) -> bool:
        return self._asleep

    def sleep(self) -> None:
        """Free the KV cache and the weights (vLLM's sleep level 2): the rank went to the
        trainer. Every pin and cached prefix is dropped. Refused while requests are in flight;
        ``wake_up`` with the weights of the version to serve makes the engine serve again."""
        with self._lock:
            if self._asleep:
                return
            if self.scheduler.has_unfinished:
                raise EngineBusyError(f"sleep: {len(self.scheduler.requests)} requests in "
                                      "flight (finish or abort them first)")
            self.scheduler.kv_cache.drop_all()
            self.runner.kv_cache = None
            self.runner.linears.clear()
            for name, param in self.model.named_parameters():
                self._shapes[name] = (param, param.shape)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self._asleep = True

    def wake_up(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Allocate the weights and the KV cache again and load ``state_dict`` (every
        parameter) as ``version``."""
        if not self._asleep:
            self.update_weights(state_dict, version)
            return
        expected = {name: shape for name, (_, shape) in self._shapes.items()}
        if self.model.config.tie_word_embeddings:
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        missing = sorted(set(expected) - set(state_dict))
        unknown = sorted(set(state_dict) - set(expected))
        wrong = sorted(k for k, v in state_dict.items()
                       if k in expected and tuple(v.shape) != tuple(expected[k]))
        for what, names in (("lack", missing), ("have unknown", unknown),
                            ("have wrong shapes for", wrong)):
            if names:  # checked before anything is allocated: it stays asleep
                raise ValueError(f"wake_up: the weights {what} {names[:3]} ({len(names)} in all)")
        with self._lock, torch.no_grad():  # one hold: no step sees it half awake
            for name, (param, shape) in self._shapes.items():
                param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
                param.copy_(state_dict[name])
            self._shapes.clear()
            num_blocks = self.scheduler.kv_cache.pool.num_blocks
            self.runner.kv_cache = self.model.new_kv_cache(num_blocks, self.config.block_size)
            self.version = version
            self._asleep = False

    def metrics(self) -> EngineMetrics:
        kv = self.scheduler.kv_cache
        with self._lock:
            stats = self.scheduler.stats()
            num_tasks = len(kv.task_ids)
        return EngineMetrics(
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            kv_cache_usage_perc=stats.kv_cache_usage_perc,
            num_requests_running=stats.num_requests_running,
            num_requests_waiting=stats.num_requests_waiting,
            num_preemptions=stats.num_preemptions,
            prompt_tokens_computed=self.prompt_tokens_computed,
            decode_tokens=self.decode_tokens, prefill_s=self.prefill_s, num_pins=kv.num_pins,
            num_tasks=num_tasks, num_pins_released=kv.num_pins_released)


def _changes_tower(params: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether loading ``state_dict`` changes a vision-tower parameter (a frozen tower arrives
    unchanged with every version: its cached embeddings stay valid)."""
    return any(name.startswith(VISION_PREFIX)
               and not torch.equal(params[name], tensor.to(params[name].device,
                                                           params[name].dtype))
               for name, tensor in state_dict.items())
