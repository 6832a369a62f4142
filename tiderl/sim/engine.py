"""One rollout rank's inference engine: continuous batching by processor sharing, with a KV cache.

    submit(request) ──> queue (FIFO) ──admit: context + output fit──> running ──V ≥ target──> done
                          ^      (prefill stalls decode)                 │ no room to grow:
                          └──────────── preempted (recompute), front ────┘ newer running goes

Every running request advances one token per engine step, and a step over B requests with
contexts summing to S takes ``CostModel.decode_step_s(B, S)``. A virtual token clock ``V`` counts
the tokens each running request has produced since the rank started, so a request that joins at
``V0`` needing ``n`` tokens finishes when ``V = V0 + n``: a heap keyed by that target gives the next
completion, and the rank keeps exactly one pending completion event (older ones are invalidated
by an epoch counter). Events happen only when membership changes, never per token.

Simplifications (documented in docs/simulator.md):
- the step time is evaluated when membership changes and held until the next change (contexts
  grow by one token per step in between; turns are short, so segments are short);
- a turn's output blocks are allocated when it is admitted (vLLM allocates them step by step
  and preempts the newest running request when decode growth fails). A queued request is
  admitted only when its context and its output fit (after evicting cached blocks), so decode
  growth never fails and recompute-preemption is left for the rare case where the cache's
  admission estimate (``peek_turn`` of context + output) and the real growth disagree: then
  running requests that arrived after it are preempted, newest first, or it waits. The
  multi-turn cost of request-level scheduling, evicted caches of tasks waiting for their
  environment (paper §2.2 C1), is modelled in full by the cache's LRU eviction;
- a prefill stalls decode on the rank for ``prefill_s`` of the admitted requests' chunks (no
  chunked-prefill mixing); a weight sync stalls it the same way.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tiderl.sim.events import EventLoop
from tiderl.sim.hardware import CostModel
from tiderl.sim.kvcache import SimKVCache

EPS_TOKENS = 1e-6  # V is a float: a target within this of V is reached


@dataclass(slots=True, eq=False)
class SimRequest:
    """One generation request (one turn of a task) on a rank."""

    task_id: str
    group_id: str
    prompt_tokens: int
    context: int  # context tokens it starts from (grows by the tokens kept on preemption)
    remaining: int  # tokens left to decode
    fresh: int  # context tokens never computed before for this task (the rest is recompute)
    kept_prefix: int | None = None
    pin: bool = False  # CTB: keep the task's KV referenced across turns
    reusable: int = 0  # of its context, what its task's previous turn left here (whole blocks,
    reused: int | None = None  # since the last flush), and of that what its admission found
    flushes: int = 0  # the cache's flushes at its submission, then at its first admission
    seq: int = 0  # admission order on the rank
    arrival: int = 0  # submission order on the rank (only a newer request may be preempted)
    v_start: float = 0.0
    v_target: float = 0.0
    u_start: float = 0.0
    gpu_s: float = 0.0  # the rank's time spent on it: its decode share and its prefills
    recompute_s: float = 0.0  # of which prefill of context computed before
    is_running: bool = False
    payload: object = field(default=None, repr=False)  # the caller's task


class RolloutEngine:
    """A rank: ``submit`` requests; ``on_done(request)`` is called when one finishes decoding."""

    def __init__(self, rank: int, loop: EventLoop, cost: CostModel, kv: SimKVCache,
                 on_done: Callable[[SimRequest], None], max_running: int | None = None) -> None:
        self.rank = rank
        self.loop = loop
        self.cost = cost
        self.kv = kv
        self.max_running = max_running
        self._on_done = on_done
        self.queue: deque[SimRequest] = deque()
        self.running: dict[int, SimRequest] = {}  # by admission seq, oldest first
        self._heap: list[tuple[float, int, SimRequest]] = []
        self._seq = 0
        self._num_submitted = 0
        self._epoch = 0
        self._wake_at: float | None = None  # the live completion event's time
        self._v = 0.0  # the virtual token clock
        self._sum_base = 0  # Σ (context − v_start) over running: Σ contexts = this + B·V
        self._step_s = 0.0
        self._t_last = loop.now
        self.stall_until = loop.now
        self.is_closed = False
        self.decoded_tokens = 0
        self.prefill_tokens = 0
        self.recomputed_tokens = 0
        # where the rank's time went (docs/simulator.md, "Where the device-seconds go")
        self.decode_s = 0.0
        self.prefill_s = 0.0
        self.sync_s = 0.0  # stalled by weight syncs
        self._u = 0.0  # decode seconds per running request since the rank started

    # ---- the caller's side ----

    def submit(self, request: SimRequest) -> None:
        self._advance()
        request.arrival = self._num_submitted
        self._num_submitted += 1
        self.queue.append(request)
        self._admit()
        self._reschedule()

    def stall(self, until: float) -> None:
        """Generation pauses until ``until`` (weight sync); running requests keep their place."""
        self._advance()
        self.sync_s += max(0.0, until - max(self.stall_until, self.loop.now))
        self.stall_until = max(self.stall_until, until)
        self._reschedule()

    def close(self) -> list[SimRequest]:
        """The rank leaves rollout: every queued and running request is returned, unfinished."""
        self._advance()
        self.is_closed = True
        self._epoch += 1
        requests = [*self.running.values(), *self.queue]
        for request in self.running.values():
            request.gpu_s += self._u - request.u_start
        for request in requests:
            request.is_running = False
        self.running.clear()
        self.queue.clear()
        self._heap.clear()
        return requests

    def settle(self) -> None:
        """Bring the time counters to now."""
        if not self.is_closed:
            self._advance()

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.queue)

    # ---- processor sharing ----

    def _advance(self) -> None:
        """Move V to now: decode ran from the last change (or the stall's end) at the held rate."""
        now = self.loop.now
        if self.running:
            start = self._t_last if self._t_last >= self.stall_until else self.stall_until
            if now > start and self._step_s > 0:
                self._v += (now - start) / self._step_s
                self._u += (now - start) / len(self.running)
                self.decode_s += now - start
        self._t_last = now

    def _reschedule(self) -> None:
        """One pending completion event for the earliest target; the step time at current size.
        A pending event that is not later than the new completion time is kept: when it fires
        early it finds nothing done and schedules the next one (one heap entry, not two)."""
        if not self.running:
            return
        batch, v = len(self.running), self._v
        step_s = self._step_s = self.cost.decode_step_s(batch, int(self._sum_base + batch * v))
        heap = self._heap
        while not heap[0][2].is_running:
            heapq.heappop(heap)
        now, stall_until = self.loop.now, self.stall_until
        start = now if now >= stall_until else stall_until
        tokens_left = heap[0][0] - v
        when = start + (tokens_left if tokens_left > 0.0 else 0.0) * step_s
        if self._wake_at is not None and self._wake_at <= when:
            return  # the pending tick comes first; it will look again (fewer heap entries)
        self._epoch += 1
        self._wake_at = when
        self.loop.at(when, self._on_tick, self._epoch)

    def _on_tick(self, epoch: int) -> None:
        if epoch != self._epoch or self.is_closed:
            return
        self._wake_at = None
        self._advance()
        heap, done = self._heap, []
        while heap and heap[0][0] <= self._v + EPS_TOKENS:
            request = heapq.heappop(heap)[2]
            if request.is_running:
                self._remove(request)
                self.decoded_tokens += request.remaining
                self.kv.end_turn(request.task_id, self.loop.now)
                done.append(request)
        if self.queue:
            self._admit()
        self._reschedule()
        for request in done:
            self._on_done(request)

    def _remove(self, request: SimRequest) -> None:
        request.is_running = False
        request.gpu_s += self._u - request.u_start
        del self.running[request.seq]
        self._sum_base -= request.context - request.v_start

    # ---- admission and preemption ----

    def _admit(self) -> None:
        """Admit queued requests in FIFO order while they fit; one prefill for all of them.
        With nothing running no completion will free a block, so while the head does not fit,
        the newest queued request holding pinned blocks gives them up (recompute-preemption of a
        waiting request: its context is computed again when it is admitted)."""
        admitted = self._admit_fitting()
        while not admitted and self.queue and not self.running and self._preempt_waiting():
            admitted = self._admit_fitting()
        if admitted:
            seconds = self.cost.prefill_s([chunk for _, chunk, _ in admitted])
            now, stall_until = self.loop.now, self.stall_until
            self.stall_until = (now if now >= stall_until else stall_until) + seconds
            self.prefill_s += seconds
            computed = sum([new for _, (new, _), _ in admitted])  # 0: a pass of no time
            for request, (new, _), recomputed in admitted:
                if new:
                    share = seconds * new / computed
                    request.gpu_s += share
                    request.recompute_s += share * recomputed / new

    def _preempt_waiting(self) -> bool:
        """Drop the blocks of the newest queued request behind the head that holds any; False
        when none does."""
        holders = [r for r in list(self.queue)[1:] if self.kv.task_blocks(r.task_id)]
        if not holders:
            return False
        self.kv.preempt(max(holders, key=lambda r: r.arrival).task_id, self.loop.now)
        return True

    def _admit_fitting(self) -> list[tuple[SimRequest, tuple[int, int], int]]:
        """The requests admitted, each with its prefill chunk (new, cached) and how many of
        the new tokens are recomputed."""
        admitted: list[tuple[SimRequest, tuple[int, int], int]] = []
        now, kv, queue, max_running = self.loop.now, self.kv, self.queue, self.max_running
        while queue and (max_running is None or len(self.running) < max_running):
            request = queue[0]
            need = request.context + request.remaining + 2 * kv.block_size
            if need > kv.free_tokens and kv.peek_turn(
                    request.task_id, request.group_id, request.prompt_tokens,
                    request.context + request.remaining, request.kept_prefix) is None:
                break  # plenty of free blocks: it surely fits, skip the (costlier) check
            alloc = kv.begin_turn(request.task_id, request.group_id, request.prompt_tokens,
                                  request.context, now, request.kept_prefix)
            if alloc is None or not self._reserve_output(request):
                break
            queue.popleft()
            if request.pin:
                kv.pin(request.task_id)
            hit, compute = alloc
            if request.reused is None:  # its first admission (not one after a preemption)
                if kv.num_flushes != request.flushes:  # a weight update while it queued
                    request.reusable, request.flushes = 0, kv.num_flushes
                request.reused = min(hit, request.reusable)
            recomputed = compute - request.fresh if compute > request.fresh else 0
            admitted.append((request, (compute, hit), recomputed))
            self.prefill_tokens += compute
            self.recomputed_tokens += recomputed
            request.fresh = 0
            self._start(request)
        return admitted

    def _reserve_output(self, request: SimRequest) -> bool:
        """Allocate the turn's output blocks, preempting running requests that arrived after it
        (newest first) if needed; if even that fails it gives its blocks back and waits."""
        while not self.kv.grow(request.task_id, request.remaining, self.loop.now):
            newer = [r for r in self.running.values() if r.arrival > request.arrival]
            if not newer:
                self.kv.preempt(request.task_id, self.loop.now)
                return False
            self._preempt(max(newer, key=lambda r: r.arrival))
        return True

    def _preempt(self, victim: SimRequest) -> None:
        """Recompute-preemption: its tokens so far join its context; it goes back to the front."""
        produced = min(victim.remaining, int(self._v - victim.v_start + EPS_TOKENS))
        self._remove(victim)
        self.kv.preempt(victim.task_id, self.loop.now)
        self.decoded_tokens += produced
        victim.context += produced
        victim.remaining -= produced
        self.queue.insert(1, victim)  # right behind the request that preempted it

    def _start(self, request: SimRequest) -> None:
        seq, v = self._seq, self._v
        self._seq += 1
        request.seq, request.v_start, request.u_start = seq, v, self._u
        request.v_target = v + request.remaining
        request.is_running = True
        self.running[seq] = request
        self._sum_base += request.context - v
        heapq.heappush(self._heap, (request.v_target, seq, request))
