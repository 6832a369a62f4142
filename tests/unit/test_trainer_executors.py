"""The executors in one process: the StepMode each reports, the batch mode's single Ref/Actor
round over a batch that streams in while the step waits, a streamed micro-batch trained before
the next arrives, no Ref pass without a KL term, and the loss tokens a rank reports."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from tiderl.core.ra2p import form_micro_batches
from tiderl.core.system import StepMode
from tiderl.models.random_init import init_model
from tiderl.runtime.rank_wire import step_done
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.executors import (
    AllReady,
    ColocatedExecutor,
    DecoupledExecutor,
    ScheduledArrivals,
    StepInput,
    StreamedStep,
)
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.worker import ActorWorker, RefWorker

CONFIG = TrainerConfig(lr=1e-3, kl_beta=0.05)
VOCAB = 1568


def _step() -> StepInput:
    samples = synthetic_samples(8, vocab_size=VOCAB, min_tokens=16, max_tokens=40, seed=3)
    mbs = form_micro_batches([s.as_sequence() for s in samples], 1, 48)
    return StepInput(tuple(mbs), {s.seq_id: s for s in samples})


def _executor(mode: StepMode, max_aggregate: int = 8) -> ColocatedExecutor:
    ref = RefWorker(make_backend("ddp", init_model("tiny", seed=1), trainable=False))
    actor = ActorWorker(make_backend("ddp", init_model("tiny", seed=0)), CONFIG)
    return ColocatedExecutor.for_step_mode(mode, ref, actor, max_aggregate=max_aggregate)


def _passes(events: list[dict], name: str) -> list[tuple[int, ...]]:
    return [tuple(e["mb_ids"]) for e in events if e["name"] == name]


@pytest.mark.parametrize(("mode", "max_aggregate", "bound", "swaps"), [
    (StepMode.COLOCATED, 4, 4, True), (StepMode.BATCH, 0, 0, True), (StepMode.BATCH, 3, 0, True),
    (StepMode.VSO, 4, 1, True), (StepMode.VS, 4, 1, False)])
def test_each_mode_gets_its_bound_and_swap_and_reports_itself(mode, max_aggregate, bound, swaps):
    executor = _executor(mode, max_aggregate)
    assert (executor.max_aggregate, executor.swapper is not None) == (bound, swaps)
    step = _step()
    assert executor.run_step(step, AllReady(len(step.micro_batches)),
                             time.time()).step_mode is mode


def test_the_decoupled_mode_and_a_negative_bound_are_refused():
    with pytest.raises(ValueError, match="DecoupledExecutor"):
        _executor(StepMode.DECOUPLED)
    with pytest.raises(ValueError, match="max_aggregate must be >= 0"):
        _executor(StepMode.COLOCATED, -1)


def test_a_batch_step_runs_one_round_over_a_batch_that_streams_in():
    step, streamed = _step(), StreamedStep()
    assert len(step.micro_batches) > 2

    def feed() -> None:
        for mb in step.micro_batches:
            time.sleep(0.05)
            streamed.add(mb, [step.samples[s.seq_id] for s in mb.sequences])
        streamed.close()

    feeder = threading.Thread(target=feed)
    feeder.start()
    result = _executor(StepMode.BATCH).run_step(streamed, streamed, time.time())
    feeder.join()
    everything = tuple(mb.mb_id for mb in step.micro_batches)
    assert _passes(result.events, "ref_forward") == [everything]
    assert len(_passes(result.events, "swap")) == 2  # to Ref, then to Actor: once each
    assert sorted(result.seq_ids) == sorted(step.samples)
    assert result.loss.loss_tokens == step.num_loss_tokens


def test_a_batch_step_waits_for_a_scheduled_batch_and_counts_it_as_waiting():
    step = _step()
    last = len(step.micro_batches) - 1
    step = StepInput(tuple(dataclasses.replace(mb, ready_time=0.04 * i)
                           for i, mb in enumerate(step.micro_batches)), step.samples)
    executor = _executor(StepMode.BATCH)
    origin = time.time()
    result = executor.run_step(step, ScheduledArrivals(step.micro_batches, origin), origin)
    assert len(_passes(result.events, "ref_forward")) == 1
    waits = [e for e in result.events if e["name"] == "wait"]
    # the one round began once the last micro-batch was there, and the time from the step's
    # first wait until then counts as waiting (however late after ``origin`` that wait began)
    assert waits[0]["end"] >= 0.04 * last - 0.01
    assert sum(e["end"] - e["start"] for e in waits) >= 0.04 * last - waits[0]["start"] - 0.01


def _fed_until_trained(executor, step: StepInput, first: int) -> tuple[list[dict], object]:
    """Run a streamed step fed only its first ``first`` micro-batches until the executor has
    back-propagated all of them; then feed the rest and close. Returns the events at that
    moment and the step's result (a deadline only guards against a hang)."""
    streamed = StreamedStep()
    for mb in step.micro_batches[:first]:
        streamed.add(mb, [step.samples[s.seq_id] for s in mb.sequences])
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(
        result=executor.run_step(streamed, streamed, time.time())))
    runner.start()
    wanted = {mb.mb_id for mb in step.micro_batches[:first]}
    deadline = time.monotonic() + 60
    while {e.mb_ids[0] for e in executor.timeline.events if e.name == "actor_backward"} < wanted:
        assert time.monotonic() < deadline, "the arrived micro-batches were not trained"
        time.sleep(0.01)
    seen = [dict(name=e.name, mb_ids=e.mb_ids) for e in executor.timeline.events]
    for mb in step.micro_batches[first:]:
        streamed.add(mb, [step.samples[s.seq_id] for s in mb.sequences])
    streamed.close()
    runner.join()
    return seen, out["result"]


def test_a_streamed_micro_batch_trains_before_the_next_one_arrives():
    """The DDP backend reduces gradients once, in optimizer_step, so the actor need not learn
    whether a micro-batch is the step's last (which waits for the next one or the close)."""
    step = _step()
    executor = _executor(StepMode.VSO)
    seen, result = _fed_until_trained(executor, step, 1)
    assert [e["name"] for e in seen] == ["wait", "swap", "ref_forward", "swap",
                                         "actor_forward", "actor_backward"]  # now waits
    assert sorted(result.seq_ids) == sorted(step.samples)
    assert result.loss.loss_tokens == step.num_loss_tokens


def test_without_kl_no_ref_pass_runs():
    step = _step()
    actor = ActorWorker(make_backend("ddp", init_model("tiny", seed=0)),
                        dataclasses.replace(CONFIG, kl_beta=0.0))
    ref = RefWorker(make_backend("ddp", init_model("tiny", seed=1), trainable=False))
    colocated = ColocatedExecutor.for_step_mode(StepMode.COLOCATED, ref, actor, max_aggregate=8)
    result = colocated.run_step(step, AllReady(len(step.micro_batches)), time.time())
    assert "ref_forward" not in {e["name"] for e in result.events}
    assert result.loss.kl_sum == 0.0 and result.loss.loss_tokens == step.num_loss_tokens

    # decoupled: the Ref rank has nothing to do, the actor waits for no ref logprobs
    ref_side = DecoupledExecutor(0, [0], [1], use_ref=False)
    assert ref_side.run_step(step, AllReady(len(step.micro_batches)), time.time()).seq_ids == []
    actor_side = DecoupledExecutor(1, [0], [1], actor=actor, use_ref=False)
    result = actor_side.run_step(step, AllReady(len(step.micro_batches)), time.time())
    assert {e["name"] for e in result.events} == {"wait", "actor_forward", "actor_backward",
                                                  "optimizer_step"}
    assert sorted(result.seq_ids) == sorted(step.samples)
    with pytest.raises(ValueError, match="only that one"):
        DecoupledExecutor(0, [0], [1], ref=ref, use_ref=False)


def test_a_rank_reports_the_steps_loss_tokens():
    step = _step()
    result = _executor(StepMode.COLOCATED).run_step(step, AllReady(len(step.micro_batches)),
                                                    time.time())
    done = step_done(2, 5, result, step)
    expected = sum(sum(s.loss_mask) for s in step.samples.values())
    assert (done.rank, done.step, done.version, done.loss_tokens) == (2, 5, 1, expected)
    assert done.step_mode == "colocated" and done.stats["t_act_f"] > 0
