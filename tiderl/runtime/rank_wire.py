"""A rank's data in the bus's shapes and back: micro-batches in, a step's report out, a task's
turns and carry both ways (the rank daemon's conversions, in one place)."""

from __future__ import annotations

from tiderl.core.types import MicroBatch, SeqRef
from tiderl.runtime.agent import TaskCarry
from tiderl.runtime.bus import CarryData, MicroBatchData, StepDone
from tiderl.runtime.trajectory_wire import image_data, images_of, sample_of, turn_data, turn_of
from tiderl.trainer.executors import StepData, StepResult, phase_times
from tiderl.trainer.sample import TrainSample


def micro_batch_of(msg: MicroBatchData) -> tuple[MicroBatch, list[TrainSample]]:
    """A micro-batch as it came on the bus, as the executors take it."""
    samples = [sample_of(s) for s in msg.samples]
    return MicroBatch(msg.mb_id, tuple(SeqRef(s.seq_id, s.num_tokens) for s in samples)), samples


def step_done(rank: int, step: int, result: StepResult, data: StepData,
              version: int | None = None, attempt: int = 0) -> StepDone:
    """What a trainer rank reports for its share of a step. ``loss_tokens``: the step's trained
    (loss-mask) tokens over all its micro-batches and ranks, the same on every trainer rank."""
    means = result.loss.means()
    if version is None:
        version = result.step.version if result.step is not None else 0
    return StepDone(
        rank=rank, step=step, version=version, step_mode=result.step_mode.value,
        loss=float(means.get("loss", 0.0)), loss_tokens=int(data.num_loss_tokens),
        grad_norm=result.step.grad_norm if result.step else 0.0, seconds=result.seconds,
        stats={**{k: float(v) for k, v in means.items()}, **phase_times(result.events)},
        attempt=attempt)


def carry_data(carry: TaskCarry) -> CarryData:
    """A task leaving this rank (its carry) as the bus takes it."""
    return CarryData(session=carry.session, turns=[turn_data(t) for t in carry.turns],
                     next_context=carry.next_context, next_images=image_data(carry.next_images),
                     next_restart=carry.next_restart, image_data=carry.image_data,
                     next_sampling=carry.next_sampling)


def carry_of(data: CarryData) -> TaskCarry:
    """A task coming to this rank from another, as its agent loop takes it."""
    return TaskCarry(data.session, [turn_of(t) for t in data.turns], data.next_context,
                     list(images_of(data.next_images)), data.next_restart,
                     dict(data.image_data), dict(data.next_sampling))
