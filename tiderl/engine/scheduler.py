"""Continuous-batching scheduler of the embedded engine (torch-free).

    add_request ──> waiting (FIFO deque) ──admit──> running (admission order) ──> finished
                     ^ front                          │ last admitted
                     └──────── preempt (recompute) ───┘

One engine step is ``schedule()`` → model runner ``execute(output)`` → ``update(result)``.
``schedule`` serves running requests first (decode, or the next prefill chunk), in admission
order, preempting the most recently admitted request whenever one cannot get a block; then, if
nothing was preempted, admits waiting requests in FIFO order while the token budget, the sequence
limit and the free blocks allow. Prefix-cache hits are skipped: a turn extending a cached context
computes only its new tokens. ``update`` appends sampled tokens, finishes requests on max_tokens
or eos, caches newly full blocks and frees finished requests' blocks.

Pins never stop the engine: ``pin`` is refused while it would leave fewer blocks out of pins than
the largest request in the engine needs, and the head of the queue, if the pins leave it too few
blocks to finish, releases pins (oldest first) until it can.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiderl.engine.block_pool import KVCacheBlock
from tiderl.engine.config import EngineConfig
from tiderl.engine.kv_cache_manager import KVCacheManager, TokenUsage, cdiv
from tiderl.engine.request import FinishReason, Request, RequestStatus, SamplingParams

if TYPE_CHECKING:
    from tiderl.engine.multimodal import PromptImages


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """What the model runner computes for one request this step."""

    request_id: str
    token_ids: list[int]  # tokens whose KV is computed this step
    positions: list[int]
    block_table: list[int]  # the request's block ids, covering every position up to the last
    slot_mapping: list[int]  # block_id * block_size + offset, one per token in token_ids
    num_computed_tokens: int  # KV already in the cache before this step (= positions[0])
    samples: bool  # the last token's logits are sampled this step (prefill done)
    sampling: SamplingParams
    num_output_tokens: int  # outputs so far (for per-request seeded sampling)
    images: PromptImages | None = None  # the request's (a model that reads images)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Per sampling request: the sampled token id and its logprob under the sampling policy."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, float]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    kv_cache_usage_perc: float  # 0..1
    token_usage: TokenUsage


class Scheduler:
    """Invariant: every running request holds blocks for all its computed tokens, the running
    list is in admission order with at most ``max_num_seqs`` requests, and each step computes
    at most ``max_num_batched_tokens`` tokens.
    """

    def __init__(
        self, config: EngineConfig, eos_token_id: int | Collection[int] | None = None,
        kv_cache_manager: KVCacheManager | None = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.eos_token_ids = eos_set(eos_token_id)
        self.kv_cache = kv_cache_manager or KVCacheManager.from_config(config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._last: SchedulerOutput | None = None

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} already added")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pin(self, task_id: str) -> int:
        """Pin the task's context (blocks); :class:`PinRefused` if that would leave fewer
        blocks out of pins than the largest request in the engine needs (one block at least)."""
        reserve = max((self.num_blocks_to_finish(r) for r in self.requests.values()), default=1)
        return self.kv_cache.pin(task_id, max(1, reserve))

    def num_blocks_to_finish(self, request: Request) -> int:
        """Blocks the request holds at its last step: KV for all but its last output token."""
        return cdiv(request.num_prompt_tokens + request.sampling.max_tokens - 1, self.block_size)

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._last is not None:
            raise RuntimeError("schedule() called twice without update()")
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, preempted):
                break  # the request preempted itself: nothing after it is running
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            i += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        num_batched = self.config.max_num_batched_tokens - budget
        self._last = SchedulerOutput(scheduled, num_batched, preempted)
        return self._last

    def update(self, output: ModelRunnerOutput) -> list[Request]:
        """Apply the runner's result of the last ``schedule()``; returns requests just finished."""
        if self._last is None:
            raise RuntimeError("update() called without schedule()")
        last, self._last = self._last, None
        finished = []
        for item in last.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:
                continue  # aborted between schedule() and update()
            request.num_computed_tokens += len(item.token_ids)
            self.kv_cache.cache_blocks(request)
            if not item.samples:
                continue
            token = output.sampled_token_ids[item.request_id]
            request.append_output(token, output.logprobs[item.request_id])
            reason = self._finish_reason(request, token)
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
                finished.append(request)
        return finished

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv_cache.num_prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.num_prefix_cache_hits,
            kv_cache_usage_perc=self.kv_cache.kv_cache_usage_perc,
            token_usage=self.kv_cache.token_usage(),
        )

    # -- helpers ---------------------------------------------------------------------------------

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        """Blocks for ``num_new`` tokens, preempting the running tail; False if self-preempted."""
        while self.kv_cache.allocate(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            self._make_room(request, hit_blocks)
            num_new = min(request.num_tokens - num_hit, budget)
            if self.kv_cache.allocate(request, num_new, hit_blocks) is None:
                break  # FIFO: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            request.set_status(RequestStatus.RUNNING)
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _make_room(self, request: Request, hit_blocks: list[KVCacheBlock]) -> None:
        """Release pins, oldest first, while they leave the request too few blocks to finish
        (it would wait at the head of the queue forever, and everyone behind it with it). The
        pinned blocks it hits are its own."""
        need = self.num_blocks_to_finish(request)
        hit = {b.block_id for b in hit_blocks}
        num_blocks = self.kv_cache.pool.num_blocks
        while need > num_blocks - len(self.kv_cache.pinned_block_ids() - hit):
            if not self.kv_cache.release_pin():
                return

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        positions = list(range(start, start + num_new))
        bs = self.block_size
        table = list(request.block_ids)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_new],
            positions=positions,
            block_table=table,
            slot_mapping=[table[p // bs] * bs + p % bs for p in positions],
            num_computed_tokens=start,
            samples=start + num_new == request.num_tokens,
            sampling=request.sampling,
            num_output_tokens=request.num_output_tokens,
            images=request.images,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.set_status(RequestStatus.PREEMPTED)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        if token in self.eos_token_ids or token in request.sampling.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.kv_cache.free(request)
        request.finish_reason = reason
        request.set_status(RequestStatus.FINISHED)
        del self.requests[request.request_id]


def eos_set(eos: int | Collection[int] | None) -> frozenset[int]:
    """The tokens that end a generation: none, one, or several (an HF eos list)."""
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
