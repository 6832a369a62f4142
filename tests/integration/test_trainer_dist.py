"""The trainer across real rank processes (gloo): data parallel equals one process, and both RA2P
modes (and the VS / VSO baselines and the whole-batch mode) train the same update while each rank
sees exactly its dispatched sequences."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tiderl.core.ra2p import dispatch_zigzag, form_micro_batches, order_smallest_last
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import pack
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.executors import (
    AllReady,
    ColocatedExecutor,
    DecoupledExecutor,
    ScheduledArrivals,
    StepInput,
)
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.spawn import RankContext, RankError, run_ranks
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.timeline import Event
from tiderl.trainer.worker import ActorWorker, RefWorker

CONFIG = TrainerConfig(lr=0.1, kl_beta=0.05)  # each step runs at lr (the schedule sets it)
VOCAB = 1568


def _samples():
    return synthetic_samples(16, vocab_size=VOCAB, min_tokens=24, max_tokens=96, seed=7)


def _actor(backend: str, group=None) -> ActorWorker:
    """An actor whose update is its (normalised, clipped) gradient: SGD keeps the comparison
    linear, where AdamW's g/sqrt(v) would magnify last-bit differences of near-zero gradients."""
    actor = ActorWorker(make_backend(backend, init_model("tiny", seed=0), group), CONFIG)
    actor.optimizer = torch.optim.SGD(actor.backend.parameters(), lr=CONFIG.lr)
    return actor


def _reference_step() -> dict[str, torch.Tensor]:
    """One process, no group: the whole batch as one micro-batch, ref logprobs first."""
    samples = _samples()
    batch = pack(samples)
    ref = RefWorker(make_backend("ddp", init_model("tiny", seed=1), trainable=False))
    actor = _actor("ddp")
    actor.train(batch, ref.ref_logprobs(batch), sync=True)
    actor.optimizer_step(batch.num_loss_tokens)
    return actor.backend.full_state_dict()


def _data_parallel_rank(ctx: RankContext, backends: tuple[str, ...]
                        ) -> dict[str, dict[str, torch.Tensor]]:
    """One step of each backend, from the same weights, on this rank's half of the samples."""
    samples = _samples()
    half = len(samples) // 2
    mine = samples[:half] if ctx.rank == 0 else samples[half:]
    out = {}
    for backend in backends:
        ref = RefWorker(make_backend("ddp", init_model("tiny", seed=1), trainable=False))
        actor = _actor(backend)
        # two micro-batches per rank: the first accumulates without a reduction
        for part, sync in ((mine[:4], False), (mine[4:], True)):
            batch = pack(part)
            actor.train(batch, ref.ref_logprobs(batch), sync=sync)
        actor.optimizer_step(sum(s.num_loss_tokens for s in samples))
        out[backend] = actor.backend.full_state_dict()
    return out


@pytest.fixture(scope="module")
def data_parallel() -> list[dict[str, dict[str, torch.Tensor]]]:
    return run_ranks(_data_parallel_rank, 2, ("ddp", "fsdp2"), timeout_s=120)  # one group


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_two_rank_step_equals_one_process_step(data_parallel, backend):
    want = _reference_step()
    for state in (rank[backend] for rank in data_parallel):
        assert state.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-6, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")


def _modes_rank(ctx: RankContext, _arg) -> dict:
    """Rank 0 is Ref and ranks 1-3 Actors (decoupled); then all four run Ref and Actor
    (colocated with aggregation, VSO, VS, the whole batch). Each layout trains one step from the
    same weights."""
    samples = _samples()
    step3 = StepInput(tuple(form_micro_batches([s.as_sequence() for s in samples], 3, 128)),
                      {s.seq_id: s for s in samples})
    step4 = StepInput(tuple(form_micro_batches([s.as_sequence() for s in samples], 4, 96)),
                      {s.seq_id: s for s in samples})
    actor_group = dist.new_group([1, 2, 3])
    out: dict = {}
    if ctx.rank == 0:
        ref = RefWorker(make_backend("ddp", init_model("tiny", seed=1), trainable=False))
        executor = DecoupledExecutor(0, [0], [1, 2, 3], ref=ref)
    else:
        actor = _actor("ddp", actor_group)
        executor = DecoupledExecutor(ctx.rank, [0], [1, 2, 3], actor=actor,
                                     actor_group=actor_group)
    dist.barrier()
    origin = time.time()
    result = executor.run_step(step3, ScheduledArrivals(step3.micro_batches, origin), origin)
    out["decoupled"] = (result.seq_ids, result.events,
                        None if ctx.rank == 0 else executor.actor.backend.full_state_dict())
    out["micro_batches_3"] = [[s.seq_id for s in mb.sequences] for mb in step3.micro_batches]
    for name, aggregate, swap in (("colocated", 8, True), ("vso", 1, True), ("vs", 1, False),
                                  ("batch", 0, True)):
        ref = RefWorker(make_backend("ddp", init_model("tiny", seed=1), trainable=False))
        actor = _actor("ddp")
        executor = ColocatedExecutor(ref, actor, max_aggregate=aggregate, swap=swap)
        dist.barrier()
        result = executor.run_step(step4, AllReady(len(step4.micro_batches)), time.time())
        assert result.step_mode == name
        out[name] = (result.seq_ids, result.events, actor.backend.full_state_dict(),
                     result.loss.loss_tokens)
    out["micro_batches_4"] = [[s.seq_id for s in mb.sequences] for mb in step4.micro_batches]
    return out


def test_ra2p_modes_train_the_same_update_on_four_ranks():
    want = _reference_step()
    samples = {s.seq_id: s for s in _samples()}
    ranks = run_ranks(_modes_rank, 4, timeout_s=180)

    # decoupled: each actor rank trained exactly its smallest-last share of every micro-batch
    mbs3 = ranks[0]["micro_batches_3"]
    assert len(mbs3) > 1
    for r in (1, 2, 3):
        expected = [s.seq_id for mb in mbs3
                    for s in order_smallest_last([samples[i].as_sequence() for i in mb], 3)[r - 1]]
        assert ranks[r]["decoupled"][0] == expected
    assert sorted(ranks[0]["decoupled"][0]) == sorted(samples)  # Ref saw every sequence once
    for r in (1, 2, 3):
        for name in want:
            torch.testing.assert_close(ranks[r]["decoupled"][2][name], want[name],
                                       rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")

    # the deferred loss: Ref ran one forward per actor share; each actor ran its forward of a
    # micro-batch before it waited for Ref's logprobs of it, and only its backward after
    # (how much the passes then overlap in time is bench/ra2p.py's measure, not a test's)
    def events(rank: int) -> list[Event]:
        return [Event(**e) for e in ranks[rank]["decoupled"][1]]
    ref_passes = [e.mb_ids for e in events(0) if e.name != "wait"]
    mb_ids = list(dict.fromkeys(ref_passes))
    assert len(mb_ids) == len(mbs3) and ref_passes == [m for m in mb_ids for _ in range(3)]
    for r in (1, 2, 3):
        passes = [(e.name, e.mb_ids) for e in events(r) if e.name != "wait"]
        assert passes == [(name, mb) for mb in mb_ids
                          for name in ("actor_forward", "wait_ref", "actor_backward")] \
            + [("optimizer_step", ())], passes

    # colocated, VSO, VS, batch: zig-zag shares, same update, swaps only where asked (no-ops on
    # CPU)
    mbs4 = ranks[0]["micro_batches_4"]
    for name in ("colocated", "vso", "vs", "batch"):
        seen = []
        for r in range(4):
            seq_ids, events_r, params, loss_tokens = ranks[r][name]
            expected = [s.seq_id for mb in mbs4
                        for s in dispatch_zigzag([samples[i].as_sequence() for i in mb], 4)[r]]
            assert seq_ids == expected
            seen += seq_ids
            assert loss_tokens == sum(s.num_loss_tokens for s in samples.values())
            for key in want:
                torch.testing.assert_close(params[key], want[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=key: f"{k}: {m}")
            swaps = [e for e in events_r if e["name"] == "swap"]
            ref_passes = [e for e in events_r if e["name"] == "ref_forward"]
            if name == "vs":
                assert not swaps
            else:
                assert swaps and all("noop" in e["note"] for e in swaps)
            if name in ("colocated", "batch"):  # all ready at the start: one aggregate
                assert len(ref_passes) == 1 and len(swaps) == 2
            else:
                assert len(ref_passes) == len(mbs4)
        assert sorted(seen) == sorted(samples)


def _failing_rank(ctx: RankContext, _arg) -> None:
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")


def test_a_failing_rank_is_reported_and_nothing_is_left_running():
    with pytest.raises(RankError, match="rank 1 failed"):
        run_ranks(_failing_rank, 2, timeout_s=60)


def test_bench_ra2p_cli_writes_every_key(tmp_path):
    """`tiderl bench ra2p --quick`: four real rank processes, JSON with the documented keys, the
    PNG beside it, and figures that hang together (a check that it runs, not a measurement)."""
    out = tmp_path / "ra2p.json"
    script = Path(sys.executable).with_name("tiderl")
    proc = subprocess.run([str(script), "bench", "ra2p", "--quick", "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(result["modes"]) == {"CM", "DM", "VS", "VSO"}
    for figures in result["modes"].values():
        assert figures["measured_s"] > 0 and figures["predicted_s"] > 0
    assert len(result["grid"]) == 2
    for cell in result["grid"]:
        assert cell["fastest"] == min(cell["measured_s"], key=cell["measured_s"].get)
        assert cell["chosen"] in ("CM", "DM")
    fraction = sum(c["chosen"] == c["fastest"] for c in result["grid"]) / 2
    assert result["chosen_is_fastest_fraction"] == fraction
    timings = result["timings"]["decoupled"]
    assert min(timings["t_ref"], timings["t_act_f"], timings["t_act_b"]) > 0
