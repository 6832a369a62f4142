"""What an actor's step leaves behind: no tensor of a step (batches, logprobs with their graph,
ref logprobs, gradients) outlives it, and the memory the step freed goes back to the OS."""

from __future__ import annotations

import resource
import time
import weakref

import pytest
import torch

from tiderl.core.ra2p import form_micro_batches
from tiderl.core.system import StepMode
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import PackedBatch
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.executors import AllReady, ColocatedExecutor, StepInput
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.worker import ActorWorker, PendingLoss, RefWorker, release_free_memory

CONFIG = TrainerConfig(lr=1e-3, kl_beta=0.05)
VOCAB = 1568
MIB = 1 << 20


def _step(seed: int) -> StepInput:
    samples = synthetic_samples(8, vocab_size=VOCAB, min_tokens=16, max_tokens=40, seed=seed)
    mbs = form_micro_batches([s.as_sequence() for s in samples], 1, 48)
    return StepInput(tuple(mbs), {s.seq_id: s for s in samples})


class _Watched:
    """Weak references to the tensors the workers hand out during a step."""

    def __init__(self, actor: ActorWorker, ref: RefWorker):
        self.refs: list[weakref.ref] = []
        forward, ref_logprobs = actor.forward, ref.ref_logprobs

        def watched_forward(batch: PackedBatch, *, sync: bool) -> PendingLoss:
            pending = forward(batch, sync=sync)
            self.watch(pending.logprobs, batch.input_ids, batch.loss_mask, batch.old_logprobs)
            return pending

        def watched_ref_logprobs(batch: PackedBatch) -> torch.Tensor:
            return self.watch(ref_logprobs(batch))

        actor.forward, ref.ref_logprobs = watched_forward, watched_ref_logprobs

    def watch(self, *tensors: torch.Tensor) -> torch.Tensor:
        self.refs += [weakref.ref(t) for t in tensors]
        return tensors[-1]

    def num_alive(self) -> int:
        return sum(r() is not None for r in self.refs)


def test_no_tensor_of_a_step_outlives_it():
    ref = RefWorker(make_backend("ddp", init_model("tiny", seed=1), trainable=False))
    actor = ActorWorker(make_backend("ddp", init_model("tiny", seed=0)), CONFIG)
    executor = ColocatedExecutor.for_step_mode(StepMode.COLOCATED, ref, actor, max_aggregate=2)
    watched = _Watched(actor, ref)
    for seed in (1, 2):
        step = _step(seed)
        result = executor.run_step(step, AllReady(len(step.micro_batches)), time.time())
        assert result.loss.loss_tokens > 0 and len(watched.refs) > 4 * len(step.micro_batches)
        del result  # no gc.collect(): a reference cycle would keep them until the collector runs
        assert watched.num_alive() == 0
        assert all(p.grad is None for p in actor.backend.parameters())


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / MIB


@pytest.mark.skipif(not release_free_memory(), reason="no glibc malloc_trim")
def test_release_free_memory_returns_the_holes_a_step_leaves_in_the_heap():
    # a large block freed raises glibc's mmap threshold past it (as a step's first activations
    # do), so the 1 MiB blocks after it come from the heap; every other one stays in use, so
    # the freed ones are holes that free() alone cannot give back
    torch.ones(16 * MIB // 4).sum()
    blocks = [torch.ones(MIB // 4) for _ in range(64)]
    allocated = _rss_mib()
    del blocks[1::2]
    release_free_memory()
    assert _rss_mib() < allocated - 24  # of the 32 MiB freed
    assert all(b.sum() == MIB // 4 for b in blocks)
