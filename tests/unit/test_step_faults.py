"""A trainer rank's death, as the step controller takes it: exact commands out."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.test_step_control import (
    BUDGET,
    IDLE,
    A,
    F,
    R,
    Ready,
    kinds,
    make,
    only,
    outcome,
    record_of,
)
from tiderl.core.commands import (
    Abort,
    AbortStep,
    Boundary,
    CloseStep,
    Dispatch,
    JoinRollout,
    LeaveRollout,
    ManualRequest,
    StartStep,
)
from tiderl.core.ers import ERSConfig
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.step_control import LayoutLimits, Phase
from tiderl.core.system import StepMode, System
from tiderl.core.types import PlanReason

NO_ERS = ERSConfig(enabled=False)


def failed(out, *ranks: int):
    """``out`` (a StepOutcome) with ``ranks`` reporting a failed part."""
    return replace(out, reports=tuple(replace(r, failed=r.rank in ranks) for r in out.reports))


def acked_all(c, version: int, now: float):
    out = []
    for rank in sorted(c.boundaries.pending.awaiting):
        out += c.boundary_acked(rank, version, now)
    return out


def open_on_two_actors(system=System.ASYNC, checkpoint_every=0):
    c = make(system, (R, A, A), steps=4, checkpoint_every=checkpoint_every)
    c.launch(0.0)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    out = c.group_ready("g1", Ready("g1", 0), 1.5)
    assert kinds(out) == ["StartStep", "Dispatch", "CloseStep"]
    return c, only(out, Dispatch)[0].mb


def test_an_actor_dying_in_a_step_it_failed_on_runs_the_step_again_on_the_others():
    c, mb = open_on_two_actors()
    assert c.rank_dead(2, "missed heartbeats", 2.0) == [AbortStep(0, 0)]
    assert c.state.roles == [R, A, IDLE] and c.state.phase is Phase.TRAINING
    out = c.step_done(failed(outcome(0, 1), 1), 3.0)  # its reduction failed: no update
    (boundary,) = out
    assert (boundary.version, boundary.roles, boundary.members, boundary.src_rank,
            boundary.reason, boundary.checkpoint) == (0, (R, A, IDLE), (0, 1), 1,
                                                      PlanReason.TRAINER_LOST, False)
    out = acked_all(c, 0, 3.5)
    assert out == [StartStep(0, StepMode.BATCH, (), (1,), 0, attempt=1), Dispatch(0, 0, mb),
                   CloseStep(0)]
    out = c.step_done(outcome(0, 1), 5.0)
    record = record_of(out)
    assert (record.trained_samples, record.trained_tokens, record.num_trainer) == (4, 400, 1)
    assert c.feed.count.trained_ids == {"g0", "g1"}
    (boundary,) = only(out, Boundary)
    assert (boundary.version, boundary.members, boundary.src_rank) == (1, (0, 1), 1)


def test_an_actor_dying_after_the_reduction_leaves_the_step_trained():
    c, _ = open_on_two_actors()
    c.rank_dead(2, "missed heartbeats", 2.0)
    out = c.step_done(outcome(0, 1), 3.0)  # the live actor updated: the step is done
    assert record_of(out).trained_samples == 4
    (boundary,) = only(out, Boundary)
    assert (boundary.version, boundary.roles, boundary.members) == (1, (R, A, IDLE), (0, 1))


def test_actors_that_disagree_on_the_update_stop_the_job():
    c = make(System.ASYNC, (R, A, A, A), steps=4)
    c.launch(0.0)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 1.5)
    c.rank_dead(3, "missed heartbeats", 2.0)
    (abort,) = c.step_done(failed(outcome(0, 1, 2), 2), 3.0)
    assert abort == Abort("step 0: actors [1] updated their weights and [2] did not (a "
                          "trainer rank died in the reduction): the replicas differ")


def test_a_ref_rank_dying_in_a_decoupled_step_runs_it_again_colocated():
    c = make(System.TIDERL, (R, F, A, A), steps=4, ers=NO_ERS,
             ra2p=RA2PConfig(placement="decoupled", tokens_per_rank=100))
    c.launch(0.0)
    (mb0,) = only(c.group_ready("g0", Ready("g0", 0), 1.0), Dispatch)  # streamed at once
    start = c.steps.current.start
    assert (start.step_mode, start.ref_ranks) == (StepMode.DECOUPLED, (1,))
    assert c.rank_dead(1, "missed heartbeats", 2.0) == [AbortStep(0, 0)]
    out = c.group_ready("g1", Ready("g1", 0), 2.5)  # formed meanwhile: waits for attempt 1
    assert only(out, Dispatch) == [] and only(out, CloseStep) == []
    # the actor set stands: no boundary, the step opens again at once
    out = c.step_done(failed(outcome(0, 2, 3), 2, 3), 3.0)
    assert c.state.roles == [R, IDLE, A, A] and only(out, Boundary) == []
    assert out[0] == StartStep(0, StepMode.COLOCATED, (), (2, 3),
                               RA2PConfig().max_aggregate, attempt=1)
    dispatched = only(out, Dispatch)  # the one sent before, then the one formed meanwhile
    assert [(d.index, d.mb.mb_id) for d in dispatched] == [(0, mb0.mb.mb_id), (1, 1)]
    assert out[-1] == CloseStep(0)
    out = c.step_done(outcome(0, 2, 3), 5.0)
    assert record_of(out).trained_samples == 4


def test_a_trainer_rank_dying_while_its_boundary_is_out_gets_it_sent_again():
    """The source died in the broadcast: the same version, from a live actor, no second
    checkpoint (the actors saved before the broadcast)."""
    c, _ = open_on_two_actors(checkpoint_every=1)
    out = c.step_done(outcome(0, 1, 2), 3.0)
    (boundary,) = only(out, Boundary)
    assert (boundary.src_rank, boundary.checkpoint) == (1, True)
    c.boundary_acked(0, 1, 3.2)
    out = c.rank_dead(1, "missed heartbeats", 4.0)
    (again,) = only(out, Boundary)
    assert (again.version, again.roles, again.members, again.src_rank, again.checkpoint) == (
        1, (R, IDLE, A), (0, 2), 2, False)
    assert c.boundaries.pending.awaiting == {0, 2}  # rank 0 took the first one: this one too
    acked_all(c, 1, 4.5)
    assert c.boundaries.pending is None and c.state.phase is Phase.WAITING  # for batch 1


def test_an_actor_dying_while_the_batch_is_awaited_gets_a_boundary_without_an_update():
    c = make(System.ASYNC, (R, A, A), steps=4)
    c.launch(0.0)
    assert c.state.phase is Phase.WAITING
    (boundary,) = c.rank_dead(1, "missed heartbeats", 1.0)
    assert (boundary.version, boundary.roles, boundary.src_rank, boundary.reason) == (
        0, (R, IDLE, A), 2, PlanReason.TRAINER_LOST)
    acked_all(c, 0, 1.5)
    c.group_ready("g0", Ready("g0", 0), 2.0)
    out = c.group_ready("g1", Ready("g1", 0), 2.5)
    assert only(out, StartStep)[0].actor_ranks == (2,)


def test_a_trainer_rank_the_job_cannot_lose_stops_it():
    sharded = make(System.ASYNC, (R, F, A, A), limits=LayoutLimits(sharded_actor_backend="fsdp2"))
    sharded.launch(0.0)
    assert sharded.rank_dead(1, "missed heartbeats", 1.0) == []  # a Ref: the actors stand
    assert sharded.state.roles == [R, IDLE, A, A]
    (abort,) = sharded.rank_dead(3, "missed heartbeats", 2.0)
    assert abort == Abort("trainer rank 3 is gone (missed heartbeats); it was an actor, and "
                          "trainer.backend fsdp2 shards the model over its actors")
    last = make(System.ASYNC, (R, A))
    last.launch(0.0)
    (abort,) = last.rank_dead(1, "killed", 1.0)
    assert abort.reason.endswith("it was the last actor that held the model and optimizer "
                                 "state")


def test_a_sync_rank_dying_leaves_rollout_and_the_trainer_set():
    c = make(System.SYNC, (R, R, R), steps=4)
    c.launch(0.0)
    tasks_on_2 = tuple(d.task_id for d in c.schedule(0.1) if d.rank == 2)
    out = c.rank_dead(2, "missed heartbeats", 1.0)
    assert out[0] == LeaveRollout(2, tasks_on_2, is_dead=True)
    (boundary,) = only(out, Boundary)
    assert (boundary.roles, boundary.members, boundary.src_rank) == ((R, R, IDLE), (0, 1), 0)
    out = acked_all(c, 0, 1.5)
    assert JoinRollout(2, BUDGET) not in out and c.rollout_ranks() == [0, 1]
    c.group_ready("g0", Ready("g0", 0), 2.0)
    out = c.group_ready("g1", Ready("g1", 0), 2.5)
    assert only(out, StartStep)[0] == StartStep(0, StepMode.BATCH, (), (0, 1), 0)


def test_the_actor_that_stays_dying_while_another_leaves_stops_the_job():
    """A boundary moves rank 2 to rollout; it took it (its model is gone) when rank 1, the actor
    that stays, dies: no live rank holds the model for certain."""
    c = make(System.ASYNC, (R, A, A), steps=4)
    c.launch(0.0)
    c.submit_manual(ManualRequest("op", 2, 1), 0.5)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 1.5)
    (boundary,) = only(c.step_done(outcome(0, 1, 2), 2.0), Boundary)
    assert boundary.roles == (R, A, R)
    c.boundary_acked(2, 1, 2.5)
    (abort,) = c.rank_dead(1, "missed heartbeats", 3.0)
    assert abort == Abort("trainer rank 1 is gone (missed heartbeats); it was the last actor "
                          "that held the model and optimizer state")


def test_a_checkpoint_is_due_only_at_the_first_boundary_of_a_version():
    c = make(System.ASYNC, (R, A, A), steps=4, checkpoint_every=1)
    c.launch(0.0)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 1.5)
    (boundary,) = only(c.step_done(outcome(0, 1, 2), 2.0), Boundary)
    assert (boundary.version, boundary.checkpoint) == (1, True)
    acked_all(c, 1, 2.5)
    (lost,) = only(c.rank_dead(2, "missed heartbeats", 3.0), Boundary)  # the batch awaited
    assert (lost.version, lost.reason, lost.checkpoint) == (1, PlanReason.TRAINER_LOST, False)
    acked_all(c, 1, 3.5)
    (moved,) = only(c.rank_dead(0, "missed heartbeats", 4.0), Boundary)  # the last rollout
    assert (moved.version, moved.reason, moved.checkpoint) == (1, PlanReason.NO_ROLLOUT, False)


def test_a_death_that_leaves_ranks_without_a_process_group_stops_the_job():
    """Past 6 ranks a job has groups for contiguous ranges only."""
    c = make(System.ASYNC, (R, R, R, R, A, A, A, A), limits=LayoutLimits(grouped_ranks=8))
    c.launch(0.0)
    (abort,) = c.rank_dead(5, "missed heartbeats", 1.0)
    assert abort.reason.startswith("trainer rank 5 is gone (missed heartbeats); it left ranks "
                                   "[0, 1, 2, 3, 4, 6, 7], which have no process group")
    ends = make(System.ASYNC, (R, R, R, R, A, A, A, A), limits=LayoutLimits(grouped_ranks=8))
    ends.launch(0.0)
    assert not only(ends.rank_dead(7, "missed heartbeats", 1.0), Abort)  # [0..6]: a range
