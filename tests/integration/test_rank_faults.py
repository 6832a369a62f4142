"""An actor's peer leaves the world in a step (its process group goes, as a dead rank's
connections do): the actor answers StepFailed without updating, drops the step's gradients, and
the step run again on it alone (after a boundary without the peer) trains exactly what a clean
one-actor step trains. A rank stopped while its step waits for micro-batches ends that step's
thread. Two real RankDaemons (gloo); the test plays the coordinator."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.integration.test_rank_backends import _steps, agreed_port
from tiderl.core.system import StepMode
from tiderl.core.types import Role
from tiderl.profile import load_profile
from tiderl.runtime.bus import StepDone, StepFailed, SyncWeights, TrainStep
from tiderl.runtime.rank import RankArgs, RankDaemon
from tiderl.trainer.executors import StreamedStep
from tiderl.trainer.spawn import RankContext, run_ranks

A, IDLE = Role.ACTOR, Role.IDLE


def train(daemon: RankDaemon, steps, step: int, actors: list[int], attempt: int = 0):
    daemon.trainer.streams[(step, attempt)] = steps[step]
    return daemon.train(TrainStep(seq=10 + step, step=step, step_mode=StepMode.COLOCATED,
                                   ref_ranks=[], actor_ranks=actors, max_aggregate=2,
                                   attempt=attempt))


async def _play(daemon: RankDaemon, variant: str) -> bool | None:
    assert daemon.world.kit is not None
    steps = _steps(daemon.world.kit.config.vocab_size)
    await train(daemon, steps, 0, [0, 1])
    members = [0] if variant == "died" else [0, 1]
    if variant == "died":
        if daemon.rank == 1:  # gone: its peer's collectives see the connections close
            dist.destroy_process_group()
            return None
        await train(daemon, steps, 1, [0, 1])  # fails in the reduction, without an update
        steps = _steps(daemon.world.kit.config.vocab_size)  # the coordinator sends them again
    await daemon._boundary(SyncWeights(seq=5, version=1, src_rank=0, roles=[A.value, IDLE.value],
                                       members=members))
    if daemon.rank == 0:
        await train(daemon, steps, 1, [0], attempt=1 if variant == "died" else 0)
    if daemon.rank == 0 and variant == "clean":
        return await _stopped_in_a_step(daemon)
    return None


async def _stopped_in_a_step(daemon: RankDaemon) -> bool:
    """The rank stops (SIGTERM cancels its tasks) while its step's thread waits for
    micro-batches that will not come: the step's stream is aborted, so that thread ends and the
    rank's exit, which joins it, does not wait for a SIGKILL. Whether the stream was aborted."""
    stream = StreamedStep()
    daemon.trainer.streams[(2, 0)] = stream
    step = asyncio.create_task(daemon.train(TrainStep(
        seq=12, step=2, step_mode=StepMode.COLOCATED, ref_ranks=[], actor_ranks=[0],
        max_aggregate=2)))
    await asyncio.sleep(0)  # the task runs to its first suspension: the step's thread
    step.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await step
    return stream.aborted


def _rank(ctx: RankContext, arg: tuple[str, str]) -> dict:
    variant, run_dir = arg
    port = agreed_port()
    dist.destroy_process_group()  # the daemon joins its own world, as in a job
    profile = load_profile("local", ["trainer.lr=1e-3", "trainer.kl_beta=0",
                                     "runtime.num_ranks=2", "runtime.rollout_ranks=1",
                                     "job.steps=2", "runtime.collective_timeout_s=30"])
    args = RankArgs(rank=ctx.rank, world_size=2, run_dir=Path(run_dir), bus="",
                    dist_init=f"tcp://127.0.0.1:{port}", env_url="", role=A)
    daemon = RankDaemon(args, profile)
    daemon.setup([A, A])
    sent: list = []
    daemon.link.send = sent.append  # what the rank would put on the bus
    stopped = asyncio.run(_play(daemon, variant))  # returns once every thread of it ended
    actor = daemon.trainer.actor
    weights = actor.backend.full_state_dict() if actor is not None else {}
    return {"sent": [(type(m).__name__, m.step, m.attempt, getattr(m, "updated", None),
                      getattr(m, "error", "")) for m in sent
                     if isinstance(m, StepDone | StepFailed)],
            "stopped_step_aborted": stopped, "version": daemon.version,
            "actor_set": daemon.trainer.actor_set,
            "weights": {k: v.clone() for k, v in weights.items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return {variant: run_ranks(_rank, 2, (variant, str(tmp_path_factory.mktemp(variant))),
                                timeout_s=300)
            for variant in ("died", "clean")}


def test_a_step_its_peer_died_in_runs_again_and_trains_what_a_clean_step_trains(runs):
    died, clean = runs["died"][0], runs["clean"][0]
    (first, failed, again) = died["sent"]
    assert first[:3] == ("StepDone", 0, 0)
    assert failed[:4] == ("StepFailed", 1, 0, False) and failed[4]  # with the gloo error
    assert again[:3] == ("StepDone", 1, 1)
    assert [m[:3] for m in clean["sent"]] == [("StepDone", 0, 0), ("StepDone", 1, 0)]
    assert died["version"] == clean["version"] == 2 and died["actor_set"] == (0,)
    for name, tensor in clean["weights"].items():
        torch.testing.assert_close(died["weights"][name], tensor, atol=0, rtol=0, msg=name)


def test_a_rank_stopped_in_a_step_that_waits_for_micro_batches_ends_the_steps_thread(runs):
    assert runs["clean"][0]["stopped_step_aborted"] is True
