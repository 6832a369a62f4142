"""The rank daemon's trainer path under each backend, on real rank processes (gloo): the same
steps and boundaries with ERS moving an actor out and back in train the same policy with DDP and
with FSDP2 (which gathers its shards for the sync and rebuilds its wrap for each new actor set).

Each rank is a real :class:`RankDaemon` (its set-up, process groups, boundary and step code);
the test plays the coordinator's part in process: it hands each rank the commands a coordinator
sends (``SyncWeights`` with the roles of an ERS plan, ``TrainStep`` with its micro-batches) in
the same order on every rank, and keeps what the rank would send (its ``StepDone``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tiderl.core.ra2p import form_micro_batches
from tiderl.core.system import StepMode
from tiderl.core.types import Role
from tiderl.profile import load_profile
from tiderl.runtime.bus import StepDone, SyncWeights, TrainStep
from tiderl.runtime.rank import RankArgs, RankDaemon
from tiderl.trainer.executors import StreamedStep
from tiderl.trainer.spawn import RankContext, free_port, run_ranks
from tiderl.trainer.synthetic import synthetic_samples

WORLD = 3
START = [Role.ROLLOUT, Role.ACTOR, Role.ACTOR]
# (roles after the boundary before the step, the step's actor ranks): rank 1 leaves training
# for rollout after step 0 and comes back after step 1 (a joiner: weights and AdamW state)
PLAN = [(START, [1, 2]),
        ([Role.ROLLOUT, Role.ROLLOUT, Role.ACTOR], [2]),
        (START, [1, 2])]


def _steps(vocab: int) -> list[StreamedStep]:
    """Three steps of synthetic GRPO samples, each cut into micro-batches as RA2P forms them."""
    steps = []
    for step in range(len(PLAN)):
        samples = synthetic_samples(12, vocab_size=vocab, min_tokens=20, max_tokens=80,
                                    seed=100 + step)
        by_id = {s.seq_id: s for s in samples}
        data = StreamedStep()
        for mb in form_micro_batches([s.as_sequence() for s in samples], 2, 160):
            data.add(mb, [by_id[s.seq_id] for s in mb.sequences])
        data.close()
        steps.append(data)
    return steps


async def _play(daemon: RankDaemon, feeds: list[str]) -> None:
    """``feeds``: every rank's weight-feed address (a job's ranks announce theirs in Hello)."""
    assert daemon.world.kit is not None
    steps = _steps(daemon.world.kit.config.vocab_size)
    members = list(range(WORLD))
    roles = START
    for step, (new_roles, actors) in enumerate(PLAN):
        if step:  # the boundary after step - 1, at version step
            old_actors = {r for r, role in enumerate(roles) if role is Role.ACTOR}
            new_actors = {r for r, role in enumerate(new_roles) if role is Role.ACTOR}
            src = min(old_actors & new_actors)
            await daemon._boundary(SyncWeights(
                seq=step, version=step, src_rank=src, roles=[r.value for r in new_roles],
                members=members, joiners=sorted(new_actors - old_actors), source=feeds[src]))
            roles = new_roles
        daemon.trainer.streams[(step, 0)] = steps[step]
        await daemon.train(TrainStep(seq=10 + step, step=step, step_mode=StepMode.COLOCATED,
                                      ref_ranks=[], actor_ranks=actors, max_aggregate=2))


def agreed_port() -> int:
    """A free port every rank of the live world agrees on, for the next world's store (outside
    the ephemeral range: no gloo connection of this world or of a test beside it can take it
    before the store binds it)."""
    port = [free_port() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    return port[0]


def _rank(ctx: RankContext, runs: list[tuple[str, str]]) -> dict[str, dict]:
    """Each (backend, run dir) in turn: a daemon that joins its own world, as in a job,
    plays the plan and leaves its world before the next one joins."""
    out = {}
    for backend, run_dir in runs:
        port = agreed_port()
        dist.destroy_process_group()
        out[backend] = _daemon_run(ctx, backend, port, run_dir)
    dist.destroy_process_group()
    return out


def _daemon_run(ctx: RankContext, backend: str, port: int, run_dir: str) -> dict:
    profile = load_profile("local", [f"trainer.backend={backend}", "trainer.lr=1e-3",
                                     "trainer.kl_beta=0", f"runtime.num_ranks={WORLD}",
                                     f"trainer.activation_checkpointing={backend == 'fsdp2'}",
                                     "runtime.rollout_ranks=1", "job.steps=3"])
    args = RankArgs(rank=ctx.rank, world_size=WORLD, run_dir=Path(run_dir), bus="",
                    dist_init=f"tcp://127.0.0.1:{port}", env_url="", role=START[ctx.rank])
    daemon = RankDaemon(args, profile)
    daemon.setup(START)
    sent: list = []
    daemon.link.send = sent.append  # what the rank would put on the bus
    feeds: list = [None] * WORLD
    dist.all_gather_object(feeds, daemon.world.feed_address)
    asyncio.run(_play(daemon, feeds))
    daemon.world.close()
    done = [m for m in sent if isinstance(m, StepDone)]
    actor = daemon.trainer.actor
    weights = actor.backend.full_state_dict() if actor is not None else {}
    return {"losses": {m.step: m.loss for m in done}, "grad_norms": {m.step: m.grad_norm
                                                                      for m in done},
            "role": daemon.role.value, "version": daemon.version,
            "weights": {k: v.clone() for k, v in weights.items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Both backends in one spawned group (a world each, one after the other)."""
    backends = ("ddp", "fsdp2")
    runs = [(backend, str(tmp_path_factory.mktemp(backend))) for backend in backends]
    ranks = run_ranks(_rank, WORLD, runs, timeout_s=300)
    return {backend: [rank[backend] for rank in ranks] for backend in backends}


def test_fsdp2_trains_the_ddp_policy_through_an_actor_leaving_and_joining(runs):
    ddp, fsdp2 = runs["ddp"], runs["fsdp2"]
    for rank in (1, 2):
        assert fsdp2[rank]["role"] == "actor" and fsdp2[rank]["version"] == len(PLAN)
    # rank 2 trained every step, rank 1 steps 0 and 2 (step 1 ran without it)
    assert sorted(ddp[2]["losses"]) == sorted(fsdp2[2]["losses"]) == [0, 1, 2]
    assert sorted(fsdp2[1]["losses"]) == [0, 2]
    for rank in (1, 2):
        for step, loss in ddp[rank]["losses"].items():
            assert fsdp2[rank]["losses"][step] == pytest.approx(loss, abs=1e-4), (rank, step)
            assert fsdp2[rank]["grad_norms"][step] == pytest.approx(
                ddp[rank]["grad_norms"][step], rel=1e-4, abs=1e-6)
    assert len({round(x, 6) for x in ddp[2]["losses"].values()}) == 3  # the policy moved
    want = ddp[2]["weights"]
    for rank in (1, 2):
        got = fsdp2[rank]["weights"]
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, atol=1e-4, rtol=0, msg=name)
