"""The trainer: one training step's executor, fed micro-batches as they become ready.

    buffer ──add(mb)──> executor ──(all of the step's micro-batches done)──> on_done(now)
                 close() ──┘ (the step's batch is complete)

Executors (paper §5.1, App. A), all timed with ``CostModel`` on the actual token counts:

    AggregatingExecutor  colocated Ref+Actor on the same T GPUs: App. A's C_col loop run live —
                         wait for data; take up to ``max_aggregate`` ready micro-batches; swap,
                         Ref over their union; swap, Actor over their union; repeat (the taken
                         micro-batches' sequences are dealt over the GPUs as one set: "loads
                         the Ref model once to process all ready batches"). With
                         max_aggregate = 1 it is vanilla streaming (a swap per alternation:
                         "vso"; a context switch instead of a swap: "vs"); with
                         ``wait_for_batch`` it waits for the whole
                         batch (areal, verl: one swap pair per step).
    PipelineExecutor     decoupled: a Ref server on R GPUs, the Actor on A GPUs; the Actor's
                         forward overlaps the Ref, its backward waits for its Ref (deferred loss):
                             ref_done_i = max(arrive_i, ref_done_{i-1}) + t_ref_i
                             fwd_done_i = max(arrive_i, act_done_{i-1}) + t_fwd_i
                             act_done_i = max(fwd_done_i, ref_done_i) + t_bwd_i

A micro-batch's time on G data-parallel GPUs is its slowest GPU's: the sequences are dealt with
the core dispatch (``dispatch_zigzag`` colocated, ``order_smallest_last`` decoupled) and each
sequence costs ``CostModel.*_s(n, n)`` (attention at its own length). TWT accumulates the
trainer's GPU-seconds with nothing to compute while its step is open. At the end an executor
reports per rank what a real rank reports (``reports``): its share of the wait and the mean
per-micro-batch pass times of the passes it ran, which RA2P and ERS then learn from.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tiderl.core.commands import RankReport, StartStep
from tiderl.core.ra2p import dispatch_zigzag, order_smallest_last
from tiderl.core.system import StepMode
from tiderl.core.types import MicroBatch, SeqRef
from tiderl.sim.events import EventLoop
from tiderl.sim.hardware import CostModel

# "vs": Ref<->Actor alternation with both models resident (no offload). No public measurement
# of the bare alternation exists (calibration §5); the paper calls it "non-negligible" (Fig. 3).
# Calibrated as the fixed, byte-independent part of a framework-level model switch: the low end
# of vLLM's sleep/wake for small models, "~0.1-0.8 s" (sleep-mode blog; calibration §5), i.e.
# releasing and re-mapping memory pools and re-binding graphs without moving weights. Conf. L.
CONTEXT_SWITCH_S = 0.1


def _slowest(per_rank: list[list[SeqRef]], cost: Callable[[int, int], float]) -> float:
    return max((sum(cost(s.num_tokens, s.num_tokens) for s in seqs) for seqs in per_rank),
               default=0.0)


def union(mbs: list[MicroBatch]) -> MicroBatch:
    """Several micro-batches processed as one: their sequences dealt over the GPUs together."""
    seqs = tuple(s for mb in mbs for s in mb.sequences)
    return MicroBatch(mbs[0].mb_id, seqs, max(mb.ready_time for mb in mbs))


def ref_time(model: CostModel, mb: MicroBatch, num_gpus: int) -> float:
    return _slowest(dispatch_zigzag(mb.sequences, num_gpus), model.ref_fwd_s)


def actor_times(model: CostModel, mb: MicroBatch, num_gpus: int,
                decoupled: bool = False) -> tuple[float, float]:
    """(forward, backward) of the Actor over ``mb`` on ``num_gpus`` GPUs."""
    deal = order_smallest_last if decoupled else dispatch_zigzag
    per_rank = deal(mb.sequences, num_gpus)
    return _slowest(per_rank, model.actor_fwd_s), _slowest(per_rank, model.actor_bwd_s)


class StepExecutor:
    """Common bookkeeping: the step's micro-batches, its end, the trainer's wait for data."""

    def __init__(self, loop: EventLoop, model: CostModel, num_gpus: int,
                 on_done: Callable[[float], None], count_wait: bool = True) -> None:
        self.loop = loop
        self.model = model
        self.num_gpus = num_gpus
        self.on_done = on_done
        self.count_wait = count_wait
        self.is_closed = False
        self.is_done = False
        self.num_micro_batches = 0
        self.tokens = 0
        self.samples = 0
        self.twt_s = 0.0
        self.busy_s = 0.0  # compute + swap seconds on the critical path
        self.pass_s = {"t_ref": 0.0, "t_act_f": 0.0, "t_act_b": 0.0}  # summed over micro-batches
        self.t_swap: float | None = None  # one swap, when the step swaps
        # GPU-seconds of the step's work (each pass's time on every GPU it holds)
        self.gpu_s = {"ref": 0.0, "actor": 0.0, "swap": 0.0, "colocate_switch": 0.0}

    def add(self, mb: MicroBatch) -> None:
        self.num_micro_batches += 1
        self.tokens += mb.num_tokens
        self.samples += len(mb.sequences)

    def _count(self, t_ref: float, t_act_f: float, t_act_b: float) -> None:
        for key, seconds in (("t_ref", t_ref), ("t_act_f", t_act_f), ("t_act_b", t_act_b)):
            self.pass_s[key] += seconds

    def reports(self, start: StartStep) -> tuple[RankReport, ...]:
        """Each rank's report: an equal share of the wait, the mean pass times of its passes
        (a decoupled step's Ref ranks ran only Ref, its actors only the Actor)."""
        n = max(1, self.num_micro_batches)
        t_ref, t_act_f, t_act_b = (self.pass_s[k] / n for k in ("t_ref", "t_act_f", "t_act_b"))
        wait = self.twt_s / max(1, len(start.ranks))
        if start.step_mode is StepMode.DECOUPLED:
            refs = tuple(RankReport(r, wait, t_ref=t_ref) for r in start.ref_ranks)
            return refs + tuple(RankReport(r, wait, t_act_f=t_act_f, t_act_b=t_act_b)
                                for r in start.actor_ranks)
        return tuple(RankReport(r, wait, t_ref, t_act_f, t_act_b, self.t_swap)
                     for r in start.ranks)

    def close(self) -> None:
        self.is_closed = True

    def _finish(self, now: float) -> None:
        if not self.is_done:
            self.is_done = True
            self.on_done(now)


class AggregatingExecutor(StepExecutor):
    """Colocated Ref+Actor with ready-batch aggregation (see the module docstring)."""

    def __init__(self, loop: EventLoop, model: CostModel, num_gpus: int,
                 on_done: Callable[[float], None], *, max_aggregate: int, t_swap: float,
                 wait_for_batch: bool = False, count_wait: bool = True,
                 setup_s: float = 0.0) -> None:
        super().__init__(loop, model, num_gpus, on_done, count_wait)
        self.max_aggregate = max_aggregate
        self.t_swap = t_swap
        self.setup_s = setup_s  # a colocated framework's rollout->train switch, before pass one
        self.wait_for_batch = wait_for_batch
        self.num_swaps = 0
        self._ready: deque[MicroBatch] = deque()
        self._is_busy = False
        self._is_kick_pending = False
        self._wait_since = loop.now

    def add(self, mb: MicroBatch) -> None:
        super().add(mb)
        self._ready.append(mb)
        self._kick_soon()

    def close(self) -> None:
        super().close()
        self._kick_soon()

    def _kick_soon(self) -> None:
        """Start after every event of this instant: micro-batches arriving together aggregate."""
        if not self._is_kick_pending:
            self._is_kick_pending = True
            self.loop.after(0.0, self._on_kick)

    def _on_kick(self, _: object) -> None:
        self._is_kick_pending = False
        self._kick()

    def _kick(self) -> None:
        if self._is_busy or self.is_done:
            return
        if not self._ready or (self.wait_for_batch and not self.is_closed):
            if self.is_closed and not self._ready:
                self._finish(self.loop.now)
            return
        now = self.loop.now
        if self.count_wait:
            self.twt_s += (now - self._wait_since) * self.num_gpus
        limit = len(self._ready) if self.wait_for_batch else self.max_aggregate
        taken = union([self._ready.popleft() for _ in range(min(limit, len(self._ready)))])
        ref = ref_time(self.model, taken, self.num_gpus)
        fwd, bwd = actor_times(self.model, taken, self.num_gpus)
        self._count(ref, fwd, bwd)
        for key, seconds in (("ref", ref), ("actor", fwd + bwd), ("swap", 2 * self.t_swap),
                             ("colocate_switch", self.setup_s)):
            self.gpu_s[key] += seconds * self.num_gpus
        duration = 2 * self.t_swap + ref + fwd + bwd + self.setup_s
        self.setup_s = 0.0  # paid once, before the first pass
        self.num_swaps += 2
        self.busy_s += duration
        self._is_busy = True
        self.loop.after(duration, self._on_iteration_done)

    def _on_iteration_done(self, _: object) -> None:
        self._is_busy = False
        self._wait_since = self.loop.now
        self._kick()


class PipelineExecutor(StepExecutor):
    """Decoupled Ref server + Actor with the deferred loss (see the module docstring)."""

    def __init__(self, loop: EventLoop, model: CostModel, num_ref: int, num_actor: int,
                 on_done: Callable[[float], None], count_wait: bool = True) -> None:
        super().__init__(loop, model, num_ref + num_actor, on_done, count_wait)
        self.num_ref = num_ref
        self.num_actor = num_actor
        self._ref_free = loop.now
        self._act_free = loop.now

    def add(self, mb: MicroBatch) -> None:
        super().add(mb)
        now = self.loop.now
        t_ref = ref_time(self.model, mb, self.num_ref)
        t_fwd, t_bwd = actor_times(self.model, mb, self.num_actor, decoupled=True)
        self._count(t_ref, t_fwd, t_bwd)
        self.gpu_s["ref"] += t_ref * self.num_ref
        self.gpu_s["actor"] += (t_fwd + t_bwd) * self.num_actor
        ref_done = max(now, self._ref_free) + t_ref
        if self.count_wait and now > self._act_free:
            self.twt_s += (now - self._act_free) * self.num_gpus
        fwd_done = max(now, self._act_free) + t_fwd
        act_done = max(fwd_done, ref_done) + t_bwd
        self.busy_s += act_done - max(now, self._act_free)
        self._ref_free, self._act_free = ref_done, act_done

    def close(self) -> None:
        super().close()
        self.loop.at(max(self.loop.now, self._act_free), self._on_drained)

    def _on_drained(self, _: object) -> None:
        self._finish(self.loop.now)


def build_executor(mode: StepMode, loop: EventLoop, model: CostModel, *, num_gpus: int,
                   num_ref: int, max_aggregate: int, on_done: Callable[[float], None],
                   count_wait: bool = True, setup_s: float = 0.0) -> StepExecutor:
    """An executor for ``mode``: decoupled (``num_ref`` of the GPUs run Ref), colocated (up to
    ``max_aggregate`` micro-batches per swap pair), vs, vso, or batch (the whole batch, one swap
    pair); ``setup_s`` is paid before a swapping executor's first pass."""
    swap = model.model_swap_s()
    if mode is StepMode.DECOUPLED:
        return PipelineExecutor(loop, model, num_ref, num_gpus - num_ref, on_done, count_wait)
    aggregate, t_swap, wait = {
        StepMode.COLOCATED: (max_aggregate, swap, False), StepMode.VS: (1, CONTEXT_SWITCH_S, False),
        StepMode.VSO: (1, swap, False), StepMode.BATCH: (1, swap, True)}[mode]
    return AggregatingExecutor(loop, model, num_gpus, on_done, max_aggregate=aggregate,
                               t_swap=t_swap, wait_for_batch=wait, count_wait=count_wait,
                               setup_s=setup_s)


def run_trainer_step(model: CostModel, mode: StepMode, ready_times: list[float], mb_tokens: int,
                     num_gpus: int, *, num_ref: int, max_aggregate: int, seq_tokens: int) -> float:
    """Seconds one step takes for micro-batches of ``mb_tokens`` tokens (sequences of
    ``seq_tokens``) arriving at ``ready_times`` (relative to the step start, which is 0)."""
    loop = EventLoop()
    end: list[float] = []
    executor = build_executor(mode, loop, model, num_gpus=num_gpus, num_ref=num_ref,
                              max_aggregate=max_aggregate, on_done=end.append)
    times = sorted(max(0.0, t) for t in ready_times)
    for i, ready in enumerate(times):
        num_seqs = max(1, mb_tokens // seq_tokens)
        sizes = [mb_tokens // num_seqs] * num_seqs
        sizes[-1] += mb_tokens - sum(sizes)
        seqs = tuple(SeqRef(f"{i}/{j}", n) for j, n in enumerate(sizes))
        loop.at(ready, executor.add, MicroBatch(i, seqs, ready))
    loop.at(times[-1] if times else 0.0, lambda _: executor.close())
    loop.run()
    return end[0]
