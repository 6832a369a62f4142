"""The rollout/train boundary on disk (``logging.batches``): a recorded step reads back as it
was written, a file that is not one is one line naming it, and a roll-out-only step on the bus
link (``runtime.train`` false) sends the ranks nothing and is recorded as not trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiderl.core.commands import AbortStep, CloseStep, Dispatch, RankReport, StartStep
from tiderl.core.system import StepMode
from tiderl.core.types import MicroBatch, SeqRef
from tiderl.profile import load_profile
from tiderl.runtime import bus as b
from tiderl.runtime.recording import BatchTape, RecordingError, read_step, shape_of, step_file
from tiderl.runtime.step_link import StepLink
from tiderl.runtime.trajectory_wire import sample_of

SMALL = ["runtime.num_ranks=3", "runtime.rollout_ranks=1", "job.group_size=2",
         "job.batch_min_groups=1", "job.batch_groups=2", "job.steps=2"]
COLOCATED = StartStep(0, StepMode.COLOCATED, (), (1, 2), 8)


def profile(*extra: str):
    return load_profile("local", [*SMALL, *extra])


def sample(seq_id: str, n: int = 4) -> b.TrainSampleData:
    return b.TrainSampleData(seq_id=seq_id, input_ids=list(range(n)), loss_mask=[0] + [1] * (n - 1),
                             logprobs=[0.0] + [-0.5] * (n - 1), advantage=0.25, version=0)


def micro_batch(step: int, index: int, *seq_ids: str) -> b.MicroBatchData:
    return b.MicroBatchData(seq=0, step=step, mb_id=index, samples=[sample(s) for s in seq_ids])


def record_steps(folder: Path, num_steps: int, *extra: str) -> BatchTape:
    """``num_steps`` steps of two micro-batches each, trained colocated on ranks 1 and 2."""
    tape = BatchTape(folder, shape_of(profile(*extra)))
    for step in range(num_steps):
        first, second = f"g{2 * step}", f"g{2 * step + 1}"
        sent = [micro_batch(step, 0, f"{first}.0", f"{first}.1"),
                micro_batch(step, 1, f"{second}.0")]
        reports = [RankReport(2, loss=0.5 + step, loss_tokens=9, grad_norm=1.0),
                   RankReport(1, loss=0.25 + step, loss_tokens=9, grad_norm=1.0)]
        tape.record(StartStep(step, StepMode.COLOCATED, (), (1, 2), 8), sent, [1.0, 0.0, 0.5],
                    reports, is_trained=True)
    return tape

# --------------------------------------------------------------------------- the format


def test_a_recorded_step_reads_back_as_it_was_written(tmp_path):
    record_steps(tmp_path, 1)
    step = read_step(tmp_path, 0)
    assert step.shape == shape_of(profile())
    assert (step.start.step_mode, step.start.actor_ranks, step.start.ref_ranks,
            step.start.max_aggregate, step.start.attempt) == (StepMode.COLOCATED, [1, 2], [], 8, 0)
    assert [[s.seq_id for s in mb.samples] for mb in step.micro_batches] == \
        [["g0.0", "g0.1"], ["g1.0"]]
    assert step.micro_batches[0].samples[0] == sample("g0.0")  # the bus's struct, whole
    assert [mb.rewards for mb in step.micro_batches] == [[1.0, 0.0], [0.5]]
    # the step's loss as metrics.jsonl has it (the actors' mean), unrounded; ranks in order
    assert (step.is_trained, step.loss, step.loss_tokens) == (True, 0.375, 9)
    assert [r.rank for r in step.ranks] == [1, 2]
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


@pytest.mark.parametrize(("content", "expected"), [
    (b"\x93\x01\x02", "is not a batch recording of this TideRL (Expected `object`, got `array`)"),
    (b"", "is not a batch recording of this TideRL (Input data was truncated)"),
    (b'{"schema": 1}', "is not a batch recording of this TideRL"),
])
def test_a_file_that_is_not_a_recorded_step_is_one_line_naming_it(tmp_path, content, expected):
    step_file(tmp_path, 0).write_bytes(content)
    with pytest.raises(RecordingError) as info:
        read_step(tmp_path, 0)
    assert str(info.value).startswith(f"{step_file(tmp_path, 0)} {expected}")
    assert "\n" not in str(info.value)


def test_a_missing_or_misplaced_step_is_one_line(tmp_path):
    record_steps(tmp_path, 2)
    step_file(tmp_path, 1).rename(step_file(tmp_path, 5))
    for step, expected in [(1, f"{tmp_path} has no recorded step 1 (it holds steps 0, 5)"),
                           (5, f"{step_file(tmp_path, 5)} holds step 1 of schema 1, not step 5 "
                               "of schema 1")]:
        with pytest.raises(RecordingError) as info:
            read_step(tmp_path, step)
        assert str(info.value) == expected

# --------------------------------------------------------------------------- roll out only


def test_a_roll_out_only_step_sends_nothing_and_is_done_with_its_batch(tmp_path):
    sent: list[b.Message] = []
    link = StepLink(lambda rank, msg: sent.append(msg), iter(range(1, 100)).__next__, 3.0,
                    BatchTape(tmp_path, shape_of(profile())), is_training=False)
    samples = {s: sample_of(sample(s)) for s in ("g0.0", "g0.1")}
    rewards = {"g0.0": 1.0, "g0.1": 0.0}
    mb = MicroBatch(0, tuple(SeqRef(s, 4) for s in samples))
    link.send(COLOCATED, samples, rewards, set())
    link.send(Dispatch(0, 0, mb), samples, rewards, set())
    assert link.outcome(set(), 1.0, (0, 0), None) is None  # its batch is not complete yet
    link.send(CloseStep(0), samples, rewards, set())
    outcome = link.outcome(set(), 1.0, (0, 0), None)
    assert sent == [] and outcome is not None and not outcome.is_trained
    assert outcome.reports == (RankReport(1), RankReport(2)) and outcome.reward_mean == 0.5
    assert link.done() == {"g0"}
    step = read_step(tmp_path, 0)
    assert (step.is_trained, step.loss, [len(m.samples) for m in step.micro_batches]) == \
        (False, None, [2])
    # an attempt a trainer rank died in ends as it is aborted: no rank updated
    link.send(StartStep(1, StepMode.COLOCATED, (), (1, 2), 8), samples, rewards, set())
    link.send(AbortStep(1, 0), samples, rewards, {2})
    outcome = link.outcome({2}, 2.0, (0, 0), None)
    assert outcome is not None and outcome.reports == (RankReport(1, failed=True),)
    assert sent == []
