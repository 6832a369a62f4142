"""The coordinator in process, on a real loopback bus with one real socket per rank and a clock
the test sets: what it sends for the controller's commands, how it takes the ranks' answers, and
that messages which are not the job's change nothing."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.bus_ranks import ARRIVE_S, Clock, Ranks
from tiderl.launch.plan import profile_roles
from tiderl.profile import load_profile
from tiderl.runtime.bus import (
    AbortStep,
    Ack,
    AdmitTask,
    BusClient,
    BusServer,
    Heartbeat,
    Hello,
    MicroBatchData,
    Rebalance,
    StepClosed,
    StepDone,
    StepFailed,
    SyncWeights,
    TaskFinished,
    TrainStep,
    TurnData,
    TurnReport,
    rank_identity,
)
from tiderl.runtime.coordinator import Coordinator
from tiderl.runtime.errors import CoordinatorError
from tiderl.runtime.run_log import RunLog

JOB = ["runtime.num_ranks=3", "runtime.rollout_ranks=1", "job.group_size=2",
       "job.batch_min_groups=1", "job.batch_groups=1", "job.steps=3", "job.max_staleness=1",
       "runtime.heartbeat_s=1", "runtime.heartbeat_misses=2", "engine.max_new_tokens=8",
       "runtime.cpu_affinity=spread"]  # ranks on cores of their own: ERS lends at a cold start


@contextlib.contextmanager
def coordinator(tmp_path: Path, *overrides: str) -> Iterator[tuple[Coordinator, Ranks, Clock]]:
    profile = load_profile("local", [*JOB, *overrides])
    clock = Clock()
    with BusServer(None) as server:
        job = Coordinator(profile, server, profile_roles(profile), RunLog(tmp_path, clock),
                          clock)
        ranks = Ranks(server, job, profile.runtime.num_ranks)
        try:
            ranks.hello()
            yield job, ranks, clock
        finally:
            ranks.close()
            job.log.close()


def of(kind, messages):
    return [m for m in messages if isinstance(m, kind)]


def turn(rank: int, task: str, context: int, running: bool = False) -> TurnReport:
    return TurnReport(rank=rank, task_id=task, tokens=2, context_tokens=context, done=False,
                      version=0, running=running)


def finished(rank: int, task: str, reward: float, version: int = 0) -> TaskFinished:
    return TaskFinished(rank=rank, task_id=task, group_id=task.rsplit(".", 1)[0], reward=reward,
                        turns=[TurnData(context_ids=[5] * 10, output_ids=[6, 7], logprobs=[0.0] * 2,
                                        version=version)], num_tokens=12)


def play_group(ranks: Ranks, job: Coordinator, group: str, rank: int = 0) -> None:
    """The probe's first turn, its sibling's admission, both tasks to the end."""
    probe, sibling = f"{group}.0", f"{group}.1"
    ranks.send(rank, turn(rank, probe, 10))
    job.schedule_round()  # the probe's footprint admits its sibling
    assert job.router.task_rank[sibling] in job.controller.rollout.book.ranks
    ranks.send(rank, finished(rank, probe, 1.0))
    ranks.send(job.router.task_rank[sibling], finished(job.router.task_rank[sibling], sibling,
                                                        0.0))


def events(tmp_path: Path, *kinds: str) -> list[dict]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if not kinds or e["kind"] in kinds]


def test_a_cold_start_a_step_and_its_boundary_on_the_bus(tmp_path):
    with coordinator(tmp_path) as (job, ranks, clock):
        job.launch()
        (launch,) = of(SyncWeights, ranks.drain(1))
        assert (launch.version, launch.roles, launch.members) == (
            0, ["rollout", "actor", "rollout"], [0, 1, 2])  # ERS lends rank 2 to rollout
        job.schedule_round()
        admitted = of(AdmitTask, ranks.drain(0))
        assert [a.task_id for a in admitted] == ["g0.0", "g1.0"]  # one probe per group
        assert admitted[0].pin and admitted[0].env == "guess"
        for rank in range(3):
            ranks.ack(rank, 0)
        assert not of(TrainStep, ranks.drain(1))  # step 0 waits for batch 0 and the loan back
        clock.now = 1.0
        play_group(ranks, job, "g0")  # batch 0 is ready: rank 2 comes back (no update)
        *_, restore = of(SyncWeights, ranks.drain(2))  # after the launch's
        assert (restore.version, restore.roles, restore.joiners) == (
            0, ["rollout", "actor", "actor"], [2])
        for rank in range(3):
            ranks.ack(rank, 0)
        got = {rank: ranks.drain(rank) for rank in (1, 2)}
        (step,) = of(TrainStep, got[1])
        assert (step.step, step.step_mode.value, step.actor_ranks) == (0, "colocated", [1, 2])
        (batch,) = of(MicroBatchData, got[1])
        assert [s.seq_id for s in batch.samples] == ["g0.0", "g0.1"]
        assert [s.advantage for s in batch.samples] == pytest.approx([1.0, -1.0], abs=1e-5)
        assert of(StepClosed, got[1]) == [StepClosed(seq=batch.seq + 1, step=0)]
        clock.now = 2.0
        for rank in (1, 2):
            ranks.send(rank, StepDone(rank=rank, step=0, version=1, step_mode="colocated",
                                      loss=0.25, loss_tokens=4, grad_norm=0.5, seconds=1.0,
                                      stats={"wait_s": 0.05, "t_ref": 0.1, "t_act_f": 0.1,
                                             "t_act_b": 0.2, "t_swap": 0.0}))
        (boundary,) = [m for m in of(SyncWeights, ranks.drain(2)) if m.version == 1]
        assert (boundary.roles, boundary.joiners) == (["rollout", "actor", "actor"], [])
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
                 .splitlines()]
    assert (record["step"], record["trained_samples"], record["reward_mean"]) == (0, 2, 0.5)
    assert (record["loss"], record["ers_reason"], record["num_trainer"]) == (0.25, "phase_end", 2)
    assert (record["trained_loss_tokens"], record["trained_tokens"]) == (4, 24)
    moves = [(e["rank"], e["src"], e["dst"]) for e in events(tmp_path, "role_change")]
    assert moves == [(2, "actor", "rollout"), (2, "rollout", "actor")]


def test_a_rank_that_dies_in_a_boundary_is_left_out_and_no_one_waits(tmp_path):
    """Each rank fetches the weights on its own: the live ranks took the boundary; the dead
    one is forgotten once its heartbeats are missed, and the boundary completes without it
    (nothing is sent again)."""
    with coordinator(tmp_path, "runtime.system=async", "runtime.rollout_ranks=2") as (
            job, ranks, clock):
        job.launch()
        job.schedule_round()
        play_group(ranks, job, "g0", rank=job.router.task_rank["g0.0"])
        (step,) = of(TrainStep, ranks.drain(2))
        assert step.step_mode.value == "batch" and step.max_aggregate == 0
        ranks.send(2, StepDone(rank=2, step=0, version=1, step_mode="batch", loss=0.1,
                               loss_tokens=4, grad_norm=0.5, seconds=1.0, stats={}))
        (boundary,) = [m for m in of(SyncWeights, ranks.drain(0)) if m.version == 1]
        assert (boundary.src_rank, boundary.source) == (2, "127.0.0.1:2")  # rank 2's Hello
        ranks.ack(0, 1)
        ranks.ack(2, 1)  # rank 1 died in it
        assert ranks.drain(0) == [] and job.controller.boundaries.pending is not None
        clock.now = 3.5  # past the heartbeat window (2 x 1 s): ranks 0 and 2 beat, rank 1 not
        for rank in (0, 2):
            ranks.send(rank, Heartbeat(rank=rank, sent_at=0.0))
        job.check_liveness()
        assert job.controller.boundaries.pending is None
        assert job.controller.state.roles[1].value == "idle"
        assert of(SyncWeights, ranks.drain(0)) == []
        job.schedule_round()
        assert of(AdmitTask, ranks.drain(0))
    assert [e["kind"] for e in events(tmp_path, "rank_dead")] == ["rank_dead"]


def test_a_failed_boundary_of_a_rank_that_then_dies_is_explained_by_its_death(tmp_path):
    """A rollout rank whose engine server died fails its boundary, and goes with its server."""
    with coordinator(tmp_path) as (job, ranks, clock):
        job.launch()
        ranks.ack(0, 0, ok=False, error="the engine server is gone")
        clock.now = job.link.window_s + 0.5
        for rank in (1, 2):  # rank 0 misses its heartbeats
            ranks.send(rank, Heartbeat(rank=rank, sent_at=0.0))
        job.check_liveness()
        clock.now += job.link.window_s + 0.5
        for rank in (1, 2):
            ranks.send(rank, Heartbeat(rank=rank, sent_at=0.0))
        job.check_liveness()  # no CoordinatorError: its failure was its death's
        assert job.controller.state.roles[0].value == "idle"


def test_a_failed_boundary_that_no_death_explains_stops_the_job_naming_the_rank(tmp_path):
    with coordinator(tmp_path) as (job, ranks, clock):
        job.launch()
        ranks.ack(0, 0, ok=False, error="the weights of version 0 stalled")
        clock.now = job.link.window_s + 0.5
        beat(ranks)
        with pytest.raises(CoordinatorError, match="rank 0 could not take the boundary of "
                           "version 0, and no rank's death explains it: the weights"):
            job.check_liveness()


def test_messages_that_are_not_the_jobs_change_nothing(tmp_path):
    with coordinator(tmp_path) as (job, ranks, clock):
        job.launch()
        job.schedule_round()
        before = (dict(job.controller.rollout.book.tasks), job.controller.state.phase)
        with BusClient(ranks.server.endpoint, None, rank_identity(7)) as stranger:
            stranger.send(Hello(rank=7, pid=1, host="h", role="rollout", device="cpu"))
            job.handle(*ranks.server.recv(ARRIVE_S))  # rank 7 is no rank of this job
        ranks.send(0, finished(0, "g9.0", 1.0))  # a group the job never fed
        ranks.send(0, finished(0, "g0.1", 1.0))  # a task CTB has not admitted yet
        ranks.send(0, turn(0, "g0.1", 50))
        ranks.send(0, turn(0, "nope", 50, running=True))
        assert (dict(job.controller.rollout.book.tasks), job.controller.state.phase) == before
        # still the default estimate
        assert job.controller.rollout.book.tasks["g0.1"].footprint == 512
        job.schedule_round()  # and the job goes on
        # a failed step: fatal, once the heartbeats had time to name a rank that died in it
        ranks.send(1, Ack(rank=1, ref=12345, ok=False, error="out of memory"))
        clock.now += job.link.window_s + 0.5
        beat(ranks)
        with pytest.raises(CoordinatorError, match="rank 1 failed: out of memory"):
            job.check_liveness()


def beat(ranks: Ranks) -> None:
    for rank in range(len(ranks.clients)):
        ranks.send(rank, Heartbeat(rank=rank, sent_at=0.0))


def test_a_step_failing_because_a_peer_died_names_the_dead_rank(tmp_path):
    with coordinator(tmp_path) as (job, ranks, clock):
        job.launch()
        for rank in range(3):  # the launch's layout: rank 1 is the one actor
            ranks.ack(rank, 0)
        ranks.send(2, Ack(rank=2, ref=999, ok=False, error="[gloo] Connection closed by peer"))
        clock.now += job.link.window_s - 0.5  # rank 1 (an actor) went silent: killed
        for rank in (0, 2):
            ranks.send(rank, Heartbeat(rank=rank, sent_at=0.0))
        with pytest.raises(CoordinatorError, match=r"trainer rank 1 is gone \(missed heartb"
                                                   r"eats\); it was the last actor"):
            job.check_liveness()


def done(rank: int, step: int, attempt: int = 0) -> StepDone:
    return StepDone(rank=rank, step=step, version=step + 1, step_mode="batch", loss=0.25,
                    loss_tokens=4, grad_norm=0.5, seconds=1.0, stats={}, attempt=attempt)


def test_a_step_an_actor_died_in_runs_again_on_the_actor_left(tmp_path):
    with coordinator(tmp_path, "runtime.system=async") as (job, ranks, clock):
        job.launch()
        job.schedule_round()
        play_group(ranks, job, "g0")
        (step,) = of(TrainStep, ranks.drain(1))
        assert (step.actor_ranks, step.attempt) == ([1, 2], 0)
        ranks.send(1, StepFailed(rank=1, step=0, attempt=0, updated=False,
                                 error="[gloo] Connection closed by peer"))
        clock.now = 2.5  # rank 2 died in the step: silent past its heartbeats (2 x 1 s)
        for rank in (0, 1):
            ranks.send(rank, Heartbeat(rank=rank, sent_at=0.0))
        job.check_liveness()
        got = ranks.drain(1)
        assert [type(m) for m in got] == [AbortStep, SyncWeights]
        assert (got[0].step, got[0].attempt) == (0, 0)
        assert (got[1].version, got[1].roles, got[1].members, got[1].src_rank) == (
            0, ["rollout", "actor", "idle"], [0, 1], 1)
        for rank in (0, 1):
            ranks.ack(rank, 0)
        again = ranks.drain(1)
        (step,) = of(TrainStep, again)
        assert (step.step, step.actor_ranks, step.attempt) == (0, [1], 1)
        (batch,) = of(MicroBatchData, again)
        assert [s.seq_id for s in batch.samples] == ["g0.0", "g0.1"] and batch.attempt == 1
        assert of(StepClosed, again)[0].attempt == 1
        ranks.send(1, done(1, 0))  # an answer of the attempt before: dropped
        assert job.controller.state.step == 0
        ranks.send(1, done(1, 0, attempt=1))
        assert job.controller.state.step == 1
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
                 .splitlines()]
    assert (record["step"], record["trained_samples"], record["num_trainer"]) == (0, 2, 1)
    (trained,) = events(tmp_path, "trained")
    assert (trained["attempt"], trained["groups"]) == (1, ["g0"])
    (dropped,) = events(tmp_path, "message_dropped")
    assert dropped["why"] == "step 0 (attempt 0) is not open"


def test_a_step_that_fails_with_every_rank_alive_stops_the_job(tmp_path):
    with coordinator(tmp_path, "runtime.system=async") as (job, ranks, clock):
        job.launch()
        job.schedule_round()
        play_group(ranks, job, "g0")
        ranks.send(1, StepFailed(rank=1, step=0, attempt=0, updated=False,
                                 error="out of memory"))
        ranks.send(2, done(2, 0))
        clock.now += job.steps.window_s + 0.5
        beat(ranks)
        with pytest.raises(CoordinatorError, match="rank 1 failed: out of memory"):
            job.check_liveness()


def test_every_rank_silent_at_once_is_one_error_not_a_chain_of_layouts(tmp_path):
    """The coordinator was stopped (SIGSTOP) past the ranks' patience: they exited, and it sees
    them all silent in one round."""
    with coordinator(tmp_path) as (job, _, clock):
        job.launch()
        clock.now += 60.0
        with pytest.raises(CoordinatorError, match=r"every rank is gone \(ranks \[0, 1, 2\]"):
            job.check_liveness()
        assert events(tmp_path, "rank_dead") == []


def test_no_message_can_break_the_loop_and_a_rank_declared_dead_is_told_to_go(tmp_path):
    with coordinator(tmp_path) as (job, ranks, _):
        job.launch()

        def broken(*_):
            raise ValueError("a bug in a handler")

        job._on_step_report = broken
        job.handle_safely(*ranks_recv(ranks, 1, StepDone(rank=1, step=0, step_mode="colocated",
                                                          loss=0.0, grad_norm=0.0,
                                                          loss_tokens=0, version=1,
                                                          seconds=0.0, stats={})))
        (error,) = events(tmp_path, "handler_error")
        assert error["message"] == "StepDone" and "a bug in a handler" in error["error"]
        job._declare_dead(0, "missed heartbeats")  # the rollout rank, stopped (SIGSTOP)
        ranks.drain(0)
        ranks.send(0, finished(0, "g0.0", 1.0))  # ... and back (SIGCONT): nothing counts
        assert "g0" not in job.controller.feed.count.trained_ids
        assert not job.store.in_flight["g0"].finished
        assert [type(m).__name__ for m in ranks.drain(0)] == ["Shutdown"]
        (dropped,) = events(tmp_path, "message_dropped")
        assert dropped["why"] == "the rank was declared dead"


def test_a_10_mb_field_in_a_message_makes_a_bounded_event_naming_it(tmp_path):
    big = "x" * 10_000_000
    with coordinator(tmp_path) as (job, ranks, _), \
            BusClient(ranks.server.endpoint, None, b"ctl-a") as operator:
        job.launch()
        ranks.send(0, finished(0, big, 1.0))  # a task not in flight: dropped
        operator.send(Rebalance(seq=1, rollout=1, trainer=2, placement=big))
        got = ranks.server.recv(ARRIVE_S)
        assert got is not None
        job.handle(*got)
    (dropped,) = events(tmp_path, "message_dropped")
    assert dropped["why"].startswith("task 'xxx") and dropped["why"].endswith(" is not in flight")
    assert len(dropped["why"]) < 100
    (refused,) = events(tmp_path, "rebalance_refused")
    assert refused["reason"].startswith("unknown RA2P placement 'xxx")
    assert "… (10,000,000 characters)" in refused["reason"] and len(refused["reason"]) < 300
    assert refused["request"].startswith("R1/T2 xxx") and len(refused["request"]) < 300


def test_the_watchdog_speaks_when_nothing_moves_and_stops_the_job_later(tmp_path):
    with coordinator(tmp_path, "runtime.watchdog_s=10", "runtime.collective_timeout_s=5"
                     ) as (job, ranks, clock):
        job.launch()
        for _ in range(2):
            clock.now += 10.5
            beat(ranks)  # alive, but no work comes back
            job.check_liveness()
        (alarm, again) = events(tmp_path, "watchdog")
        assert alarm["idle_s"] == 10.5 and again["idle_s"] == 21.0
        assert alarm["phase"] in ("boundary", "training", "waiting")
        clock.now += 10.5
        beat(ranks)
        with pytest.raises(CoordinatorError, match="no progress for 32 s"):
            job.check_liveness()


def ranks_recv(ranks: Ranks, rank: int, msg) -> tuple:
    ranks.clients[rank].send(msg)
    got = ranks.server.recv(ARRIVE_S)
    assert got is not None
    return got
