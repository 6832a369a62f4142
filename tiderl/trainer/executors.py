"""RA2P executors: how one step's micro-batches go through the Ref and Actor models.

- ``DecoupledExecutor`` (paper §5.1, Fig. 6): Ref on its own rank(s), Actor on the others. Each
  micro-batch is dispatched over the actor ranks smallest-last (``order_smallest_last``). An actor
  rank runs its forward as soon as the micro-batch arrives and builds the loss (with its KL) only
  in the backward, once the ref logprobs of its share have come from its Ref rank; the Ref rank
  computes the shares one after another, in feed order, and sends each as soon as it is done.
- ``ColocatedExecutor``: Ref and Actor on the same ranks; the ready micro-batches are aggregated
  (up to ``max_aggregate``): Ref over all of them, one swap, Actor over all of them. Inputs and ref
  logprobs are handed from one model to the other as the same tensors (no copy, no serialisation).
  ``max_aggregate=1`` gives the vanilla streaming baselines: VSO (a swap per model change) and,
  with ``swap=False``, VS (both models resident). ``max_aggregate=0`` (no bound) is the batch
  mode: one round over the whole batch.

Every executor returns the same ``StepResult``, which names the :class:`StepMode` it ran. The
step's global batch (its micro-batches in order and their samples) is known to every trainer rank;
each rank computes the dispatch with the same ``tiderl.core.ra2p`` function and trains exactly its
share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from tiderl.core.ra2p import dispatch_zigzag, order_smallest_last
from tiderl.core.system import StepMode
from tiderl.core.types import MicroBatch
from tiderl.trainer.batch import PackedBatch, pack
from tiderl.trainer.loss import LossStats
from tiderl.trainer.sample import TrainSample
from tiderl.trainer.timeline import Timeline
from tiderl.trainer.worker import ActorWorker, RefWorker, StepStats

WHOLE_BATCH = 0  # max_aggregate without a bound: one round takes every micro-batch of the step


@dataclass(frozen=True)
class StepInput:
    """The micro-batches of one step, in the order they become ready, and their samples."""

    micro_batches: tuple[MicroBatch, ...]
    samples: Mapping[str, TrainSample]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.samples[s.seq_id].num_loss_tokens
                   for mb in self.micro_batches for s in mb.sequences)


class Arrivals(Protocol):
    """When the step's micro-batches become available on this rank (a prefix at a time)."""

    def wait(self, index: int) -> bool:
        """Block until micro-batch ``index`` is available (True) or the step is known to have
        fewer micro-batches (False)."""

    def num_ready(self) -> int:
        """How many micro-batches are available now."""

    def is_last(self, index: int) -> bool:
        """Whether available micro-batch ``index`` is the step's last (may block until known)."""


class AllReady:
    """Every micro-batch is available at the step start (RAS = N)."""

    def __init__(self, count: int):
        self.count = count

    def wait(self, index: int) -> bool:
        return index < self.count

    def num_ready(self) -> int:
        return self.count

    def is_last(self, index: int) -> bool:
        return index == self.count - 1


class ScheduledArrivals:
    """Micro-batch ``i`` becomes available ``ready_time`` seconds after ``origin`` (wall clock):
    the synthetic arrival schedules of the benchmark."""

    def __init__(self, micro_batches: tuple[MicroBatch, ...], origin: float):
        self.ready_at = [origin + mb.ready_time for mb in micro_batches]

    def wait(self, index: int) -> bool:
        if index >= len(self.ready_at):
            return False
        delay = self.ready_at[index] - time.time()
        if delay > 0:
            time.sleep(delay)
        return True

    def num_ready(self) -> int:
        now = time.time()
        return sum(1 for t in self.ready_at if t <= now)

    def is_last(self, index: int) -> bool:
        return index == len(self.ready_at) - 1


class StreamedStep:
    """A step whose micro-batches arrive while it runs (the runtime's streaming trainer): both
    the step's data (``micro_batches``, ``samples``) and its :class:`Arrivals`.

    The feeding thread calls ``add`` for each micro-batch as the global buffer forms it and
    ``close`` once the batch is complete; the executor's thread blocks in ``wait``. Until
    ``close``, ``num_loss_tokens`` covers only what has arrived. ``abort`` (a trainer rank of
    the step died) makes the executor's next wait raise :class:`StepAborted`; what arrives
    after it is dropped."""

    def __init__(self) -> None:
        self.micro_batches: list[MicroBatch] = []
        self.samples: dict[str, TrainSample] = {}
        self.closed = False
        self.aborted = False
        self._cond = threading.Condition()

    @property
    def num_loss_tokens(self) -> int:
        with self._cond:
            return sum(self.samples[s.seq_id].num_loss_tokens
                       for mb in self.micro_batches for s in mb.sequences)

    def add(self, mb: MicroBatch, samples: list[TrainSample]) -> None:
        with self._cond:
            if self.aborted:
                return
            if self.closed:
                raise ValueError(f"micro-batch {mb.mb_id} arrived after its step was closed")
            self.samples.update((s.seq_id, s) for s in samples)
            self.micro_batches.append(mb)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self.aborted = True
            self._cond.notify_all()

    def _wait_for(self, predicate: Callable[[], bool]) -> None:
        self._cond.wait_for(lambda: predicate() or self.aborted)
        if self.aborted:
            raise StepAborted("the step was aborted: a trainer rank of it died")

    def wait(self, index: int) -> bool:
        with self._cond:
            self._wait_for(lambda: index < len(self.micro_batches) or self.closed)
            return index < len(self.micro_batches)

    def num_ready(self) -> int:
        with self._cond:
            return len(self.micro_batches)

    def is_last(self, index: int) -> bool:
        with self._cond:
            self._wait_for(lambda: index + 1 < len(self.micro_batches) or self.closed)
            return index + 1 >= len(self.micro_batches)


class StepAborted(RuntimeError):
    """The step a rank was running was aborted (:meth:`StreamedStep.abort`)."""


StepData = StepInput | StreamedStep


@dataclass
class StepResult:
    step_mode: StepMode
    seconds: float  # step start to the end of the last backward on this rank
    loss: LossStats  # summed over the step's actor ranks
    step: StepStats | None  # None on a rank without an actor
    seq_ids: list[str] = field(default_factory=list)  # the sequences this rank trained
    events: list[dict] = field(default_factory=list)


class ModelSwap:
    """Moves the idle model out of device memory and the next one in (the colocated swap).

    On a GPU the idle model's parameters go to host memory and the next model's come back; on
    the CPU both already live in host memory, so a swap moves nothing and its timeline event says
    ``noop``."""

    def __init__(self, models: Mapping[str, torch.nn.Module], device: torch.device):
        self.models = dict(models)
        self.device = device
        self.active: str | None = None

    @property
    def moves_memory(self) -> bool:
        return self.device.type != "cpu"

    def to(self, name: str, timeline: Timeline) -> None:
        if name == self.active:
            return
        note = "offload+load" if self.moves_memory else "noop"
        with timeline.span("swap", note=f"{self.active}->{name} {note}"):
            if self.moves_memory:
                for other, module in self.models.items():
                    _move(module, self.device if other == name else torch.device("cpu"))
                torch.cuda.synchronize(self.device)
        self.active = name


def _move(module: torch.nn.Module, device: torch.device) -> None:
    # Swap the storage under each parameter, keeping the Parameter objects (and so the optimizer's
    # and DDP's references to them).
    for param in module.parameters():
        param.data = param.data.to(device, non_blocking=True)


def _arrived(step: StepData, arrivals: Arrivals, timeline: Timeline):
    """The step's micro-batches in arrival order, each once it is available (waits recorded)."""
    index = 0
    while True:
        with timeline.span("wait", (index,)):
            if not arrivals.wait(index):
                return
        yield step.micro_batches[index]
        index += 1


def _shares(step: StepData, per_rank: list[list]) -> list[list[TrainSample]]:
    return [[step.samples[s.seq_id] for s in seqs] for seqs in per_rank]


def _reduce_loss(stats: LossStats, group: dist.ProcessGroup | None) -> LossStats:
    """The step's loss figures over the actor group. Reduced before the optimizer step, so that
    the gradients' reduction in it is the step's last collective: an actor whose peer dies
    either fails before it updates or updates with every peer's gradients (the runtime then
    knows the step was trained, or runs it again on the actors left)."""
    if not dist.is_initialized():
        return stats
    values = stats.as_tensor()
    dist.all_reduce(values, group=group)
    return LossStats.from_tensor(values)


def p2p_tag(step: int, attempt: int, mb_id: int) -> int:
    """A 31-bit tag for a step's micro-batch: 14 bits of the step, 3 of the attempt, 14 of the
    micro-batch (each modulo its width: tags repeat only 16,384 steps apart)."""
    return (step % (1 << 14)) << 17 | (attempt % 8) << 14 | mb_id % (1 << 14)


class DecoupledExecutor:
    """One rank of the decoupled layout: ``ref`` on the ranks in ``ref_ranks``, ``actor`` on the
    ranks in ``actor_ranks`` (global ranks; ``actor_group`` is the actor ranks' process group).
    Actor rank ``actor_ranks[i]`` gets its ref logprobs from ``ref_ranks[i % len(ref_ranks)]``.

    ``use_ref=False`` (``kl_beta`` 0: the loss has no KL term) skips the Ref model: a Ref rank
    has no worker and returns at once, an actor waits for no ref logprobs.

    The ref logprobs go point to point over ``p2p_group`` (one with every rank of the step,
    whose timeout bounds a wait on a peer that died; None: the world), each tagged with its
    step, attempt and micro-batch (:func:`p2p_tag`): a send an aborted attempt left unreceived
    can never be taken for another's."""

    step_mode = StepMode.DECOUPLED

    def __init__(self, rank: int, ref_ranks: list[int], actor_ranks: list[int], *,
                 ref: RefWorker | None = None, actor: ActorWorker | None = None,
                 actor_group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 use_ref: bool = True, p2p_group: dist.ProcessGroup | None = None,
                 step: int = 0, attempt: int = 0):
        if (rank in ref_ranks) == (rank in actor_ranks):
            raise ValueError(f"rank {rank} must be exactly one of ref {ref_ranks} / actor "
                             f"{actor_ranks} in the decoupled layout")
        is_ref = rank in ref_ranks
        if ((ref is not None) != (is_ref and use_ref)
                or (actor is None) == (rank in actor_ranks)):
            raise ValueError(f"rank {rank}: give the worker of its role and only that one")
        self.use_ref = use_ref
        self.rank = rank
        self.ref_ranks = list(ref_ranks)
        self.actor_ranks = list(actor_ranks)
        self.ref, self.actor = ref, actor
        self.actor_group = actor_group
        self.p2p_group, self.step, self.attempt = p2p_group, step, attempt
        self.device = torch.device(device)
        self.timeline = Timeline(rank)

    def _tag(self, mb: MicroBatch) -> int:
        return p2p_tag(self.step, self.attempt, mb.mb_id)

    def ref_rank_of(self, actor_index: int) -> int:
        return self.ref_ranks[actor_index % len(self.ref_ranks)]

    def dispatch(self, mb: MicroBatch) -> list[list]:
        return order_smallest_last(mb.sequences, len(self.actor_ranks))

    def run_step(self, step: StepData, arrivals: Arrivals, origin: float) -> StepResult:
        self.timeline.start_step(origin)
        if self.actor is None:
            if not self.use_ref:  # no KL: nothing for a Ref rank to compute
                return StepResult(self.step_mode, 0.0, LossStats(), None)
            return self._run_ref(step, arrivals)
        return self._run_actor(step, arrivals)

    def _run_ref(self, step: StepData, arrivals: Arrivals) -> StepResult:
        served = [i for i in range(len(self.actor_ranks)) if self.ref_rank_of(i) == self.rank]
        sends: list[dist.Work] = []
        seq_ids: list[str] = []
        for mb in _arrived(step, arrivals, self.timeline):
            shares = _shares(step, self.dispatch(mb))
            for i in served:  # feed order: actor 0's share first, so actor M-1 waits longest
                batch = pack(shares[i], self.device)
                note = f"to rank {self.actor_ranks[i]}"
                with self.timeline.span("ref_forward", (mb.mb_id,), note):
                    ref_logprobs = self.ref.ref_logprobs(batch).contiguous()
                sends.append(dist.isend(ref_logprobs, dst=self.actor_ranks[i],
                                        group=self.p2p_group, tag=self._tag(mb)))
                seq_ids += batch.seq_ids
        seconds = self.timeline.now()
        for work in sends:
            work.wait()
        return StepResult(self.step_mode, seconds, LossStats(), None, seq_ids,
                          self.timeline.as_dicts())

    def _run_actor(self, step: StepData, arrivals: Arrivals) -> StepResult:
        me = self.actor_ranks.index(self.rank)
        src = self.ref_rank_of(me)
        stats = LossStats()
        seq_ids: list[str] = []
        for index, mb in enumerate(_arrived(step, arrivals, self.timeline)):
            batch = pack(_shares(step, self.dispatch(mb))[me], self.device)
            ref_logprobs = pending_recv = None
            if self.use_ref:
                ref_logprobs = torch.empty(batch.input_ids.shape, device=self.device)
                pending_recv = dist.irecv(ref_logprobs, src=src, group=self.p2p_group,
                                          tag=self._tag(mb))
            sync = self.actor.reduces_in_backward and arrivals.is_last(index)
            with self.timeline.span("actor_forward", (mb.mb_id,)):
                pending = self.actor.forward(batch, sync=sync)
            if pending_recv is not None:
                with self.timeline.span("wait_ref", (mb.mb_id,)):
                    pending_recv.wait()
            with self.timeline.span("actor_backward", (mb.mb_id,)):
                stats += self.actor.backward(pending, ref_logprobs)
            seq_ids += batch.seq_ids
        seconds = self.timeline.now()
        stats = _reduce_loss(stats, self.actor_group)  # before: see _reduce_loss
        with self.timeline.span("optimizer_step"):
            step_stats = self.actor.optimizer_step(step.num_loss_tokens)
        return StepResult(self.step_mode, seconds, stats, step_stats, seq_ids,
                          self.timeline.as_dicts())


class ColocatedExecutor:
    """One rank of the colocated layout: Ref and Actor on every rank of ``group``, each
    micro-batch dispatched zig-zag over them. ``max_aggregate`` bounds the micro-batches of one
    Ref/Actor round (``WHOLE_BATCH``: no bound, the round waits for the step's last one)."""

    def __init__(self, ref: RefWorker | None, actor: ActorWorker, *, max_aggregate: int,
                 swap: bool = True, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu"):
        if max_aggregate < 0:
            raise ValueError(f"max_aggregate must be >= 0 (0: no bound), got {max_aggregate}")
        if actor.config.kl_beta == 0:
            ref = None  # the loss has no KL term: no Ref pass
        self.ref, self.actor = ref, actor
        self.max_aggregate = max_aggregate
        self.group = group
        self.device = torch.device(device)
        self.dp_rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.dp_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.timeline = Timeline(dist.get_rank() if dist.is_initialized() else 0)
        models = {"actor": actor.backend.module}
        if ref is not None:
            models["ref"] = ref.backend.module
        self.swapper = ModelSwap(models, self.device) if swap else None

    @classmethod
    def for_step_mode(cls, mode: StepMode, ref: RefWorker | None, actor: ActorWorker, *,
                 max_aggregate: int, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> ColocatedExecutor:
        """The executor of a step mode other than decoupled; ``max_aggregate`` bounds the
        colocated mode's rounds (BATCH has no bound, VSO and VS take one micro-batch)."""
        if mode is StepMode.DECOUPLED:
            raise ValueError("the decoupled mode runs on a DecoupledExecutor")
        bounds = {StepMode.BATCH: WHOLE_BATCH, StepMode.VSO: 1, StepMode.VS: 1}
        return cls(ref, actor, max_aggregate=bounds.get(mode, max_aggregate),
                   swap=mode.has_swaps, group=group, device=device)

    @property
    def step_mode(self) -> StepMode:
        """The step mode this executor runs, as its bound and swap make it."""
        if self.max_aggregate == WHOLE_BATCH:
            return StepMode.BATCH
        if self.max_aggregate > 1:
            return StepMode.COLOCATED
        return StepMode.VSO if self.swapper is not None else StepMode.VS

    def _swap_to(self, name: str) -> None:
        if self.swapper is not None:
            self.swapper.to(name, self.timeline)

    def run_step(self, step: StepData, arrivals: Arrivals, origin: float) -> StepResult:
        self.timeline.start_step(origin)
        stats = LossStats()
        seq_ids: list[str] = []
        index = 0
        while True:
            with self.timeline.span("wait", (index,)):
                count = self._round_size(arrivals, index)
            if count == 0:
                break
            seq_ids += self._run_round(step, arrivals, index, count, stats)
            index += count
        seconds = self.timeline.now()
        stats = _reduce_loss(stats, self.group)  # before: see _reduce_loss
        with self.timeline.span("optimizer_step"):
            step_stats = self.actor.optimizer_step(step.num_loss_tokens)
        return StepResult(self.step_mode, seconds, stats, step_stats, seq_ids,
                          self.timeline.as_dicts())

    def _run_round(self, step: StepData, arrivals: Arrivals, index: int, count: int,
                   stats: LossStats) -> list[str]:
        """Ref over micro-batches ``index`` to ``index + count - 1``, one swap, Actor over them;
        their loss stats are added to ``stats``, the sequences trained returned."""
        group = step.micro_batches[index:index + count]
        batches: list[PackedBatch] = [
            pack(_shares(step, dispatch_zigzag(mb.sequences, self.dp_size))[self.dp_rank],
                 self.device) for mb in group]
        ref_logprobs: list[torch.Tensor | None] = [None] * count
        if self.ref is not None:
            self._swap_to("ref")
            with self.timeline.span("ref_forward", tuple(mb.mb_id for mb in group)):
                ref_logprobs = [self.ref.ref_logprobs(b) for b in batches]
        self._swap_to("actor")
        seq_ids: list[str] = []
        for offset, (mb, batch) in enumerate(zip(group, batches, strict=True)):
            # only a backend that reduces in backward waits here for the next micro-batch (or
            # the step's close) to learn whether this one is the last
            sync = self.actor.reduces_in_backward and arrivals.is_last(index + offset)
            with self.timeline.span("actor_forward", (mb.mb_id,)):
                pending = self.actor.forward(batch, sync=sync)
            with self.timeline.span("actor_backward", (mb.mb_id,)):
                stats += self.actor.backward(pending, ref_logprobs[offset])
            seq_ids += batch.seq_ids
        return seq_ids

    def _round_size(self, arrivals: Arrivals, index: int) -> int:
        """How many micro-batches from ``index`` on the next round takes, once they are there
        (0: the step has no more): the ready ones up to the bound, or without a bound every one
        up to the step's last."""
        if not arrivals.wait(index):
            return 0
        if self.max_aggregate != WHOLE_BATCH:
            return max(1, min(arrivals.num_ready() - index, self.max_aggregate))
        count = 1
        while not arrivals.is_last(index + count - 1) and arrivals.wait(index + count):
            count += 1
        return count


def phase_times(events: list[dict]) -> dict[str, float]:
    """Per-micro-batch pass times (``t_ref``, ``t_act_f``, ``t_act_b``: the RA2P cost model's
    inputs, measured), the mean swap, and ``wait_s``: this rank's time waiting for data."""
    spans: dict[str, float] = {}
    mbs: dict[str, set] = {}
    for event in events:
        name = event["name"]
        spans[name] = spans.get(name, 0.0) + event["end"] - event["start"]
        mbs.setdefault(name, set()).update(event["mb_ids"])
    times = {"wait_s": spans.get("wait", 0.0) + spans.get("wait_ref", 0.0)}
    for key, name in (("t_ref", "ref_forward"), ("t_act_f", "actor_forward"),
                      ("t_act_b", "actor_backward")):
        if mbs.get(name):
            times[key] = spans[name] / len(mbs[name])
    swaps = [e for e in events if e["name"] == "swap"]
    if swaps:
        times["t_swap"] = spans["swap"] / len(swaps)
    return times
