"""Runtime parts with exact answers: the trainer process-group sets, the streamed step's arrival
semantics (real threads), and the per-micro-batch times a rank reports."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from tiderl.core.rank_sets import MAX_ALL_SUBSETS, has_group, trainer_sets
from tiderl.core.types import MicroBatch, SeqRef
from tiderl.trainer.executors import StreamedStep, phase_times
from tiderl.trainer.sample import TrainSample


def test_small_jobs_get_a_group_for_every_rank_set():
    sets = trainer_sets(4)
    assert len(sets) == 15 and len(set(sets)) == 15
    assert (0,) in sets and (1, 3) in sets and (0, 1, 2, 3) in sets
    assert has_group({3, 1}, 4) and not has_group(set(), 4) and not has_group({4}, 4)


def test_large_jobs_get_contiguous_ranges_only():
    n = MAX_ALL_SUBSETS + 2
    sets = trainer_sets(n)
    assert len(sets) == n * (n + 1) // 2
    assert all(s == tuple(range(s[0], s[-1] + 1)) for s in sets)
    assert has_group({2, 3, 4}, n) and not has_group({1, 3}, n)
    with pytest.raises(ValueError):
        trainer_sets(0)


def _sample(seq_id: str) -> TrainSample:
    return TrainSample(seq_id, (1, 2, 3), (0, 1, 1), (0.0, -0.5, -0.5), 1.0, 0)


def _mb(mb_id: int, *ids: str) -> tuple[MicroBatch, list[TrainSample]]:
    return MicroBatch(mb_id, tuple(SeqRef(i, 3) for i in ids)), [_sample(i) for i in ids]


def test_a_streamed_step_blocks_until_data_or_close_and_knows_its_last_micro_batch():
    step = StreamedStep()
    seen: queue.Queue[tuple[int, bool]] = queue.Queue()

    def consume() -> None:
        index = 0
        while step.wait(index):
            seen.put((index, step.is_last(index)))
            index += 1

    worker = threading.Thread(target=consume)
    worker.start()
    step.add(*_mb(0, "a", "b"))
    time.sleep(0.05)  # time to answer too early, if it would
    assert seen.empty()  # mb 0 arrived, but whether it is the last one is not known yet
    step.add(*_mb(1, "c"))
    assert _answer(seen) == (0, False)
    time.sleep(0.05)
    assert seen.empty()  # nor whether mb 1 is
    step.close()
    assert _answer(seen) == (1, True)
    worker.join(ANSWER_S)
    assert not worker.is_alive() and seen.empty()  # closed: no third micro-batch
    assert step.num_loss_tokens == 6 and step.num_ready() == 2
    with pytest.raises(ValueError, match="after its step was closed"):
        step.add(*_mb(2, "d"))


ANSWER_S = 30.0  # a consumer thread that has not answered by then never will


def _answer(seen: queue.Queue[tuple[int, bool]]) -> tuple[int, bool]:
    """The consumer's next answer, once it has given it."""
    try:
        return seen.get(timeout=ANSWER_S)
    except queue.Empty:
        raise AssertionError(f"the consumer gave no answer in {ANSWER_S:.0f} s") from None


def test_phase_times_are_per_micro_batch_and_waits_add_up():
    events = [
        {"name": "wait", "start": 0.0, "end": 0.5, "mb_ids": [0]},
        {"name": "ref_forward", "start": 0.5, "end": 1.1, "mb_ids": [0, 1]},
        {"name": "swap", "start": 1.1, "end": 1.2, "mb_ids": []},
        {"name": "actor_forward", "start": 1.2, "end": 1.6, "mb_ids": [0]},
        {"name": "actor_backward", "start": 1.6, "end": 2.4, "mb_ids": [0]},
        {"name": "actor_forward", "start": 2.4, "end": 2.8, "mb_ids": [1]},
        {"name": "wait_ref", "start": 2.8, "end": 3.0, "mb_ids": [1]},
        {"name": "actor_backward", "start": 3.0, "end": 3.8, "mb_ids": [1]},
    ]
    times = phase_times(events)
    assert times["t_ref"] == pytest.approx(0.3)  # one pass over two micro-batches
    assert times["t_act_f"] == pytest.approx(0.4) and times["t_act_b"] == pytest.approx(0.8)
    assert times["t_swap"] == pytest.approx(0.1) and times["wait_s"] == pytest.approx(0.7)
