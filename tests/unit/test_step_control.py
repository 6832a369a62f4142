"""The step controller on scripted event sequences: exact commands out (no substrate)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tiderl.core.commands import (
    Abort,
    AbortStep,
    Boundary,
    CloseStep,
    Dispatch,
    FeedGroups,
    Finish,
    GroupDropped,
    GroupSpec,
    JoinRollout,
    LeaveRollout,
    ManualReply,
    ManualRequest,
    RankReport,
    RecordStep,
    Retire,
    StartStep,
    StepOutcome,
)
from tiderl.core.ctb import CTBConfig
from tiderl.core.ers import ERSConfig
from tiderl.core.job import JobShape
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.step_control import (
    LayoutLimits,
    Phase,
    RolloutControl,
    StepControlError,
    StepController,
    Substrate,
    effective_config,
    initial_roles,
    restore,
    resume_point,
    task_id,
)
from tiderl.core.step_control.inputs import MeasuredPasses, layout_timings
from tiderl.core.system import StepMode, System, SystemSpec
from tiderl.core.types import Admit, Group, Placement, PlanReason, Ra2pTimings, Role, SeqRef, Task

R, A, F, IDLE = Role.ROLLOUT, Role.ACTOR, Role.REF, Role.IDLE
G = 2  # group size
BUDGET = 1000


@dataclass
class Ready:
    """A finished group as the buffer takes it."""

    group_id: str
    oldest_version: int
    tokens: int = 100

    @property
    def sequences(self) -> tuple[SeqRef, ...]:
        return tuple(SeqRef(task_id(self.group_id, i), self.tokens) for i in range(G))

    @property
    def num_samples(self) -> int:
        return G


def source(spec: GroupSpec) -> Group:
    tasks = tuple(Task(task_id(spec.group_id, i), spec.group_id, "guess", spec.is_eval)
                  for i in range(G))
    return Group(spec.group_id, tasks)


def make(system: System = System.TIDERL, roles=(R, A), *, steps: int = 5, staleness: int = 1,
         carry: int = 0, batch: int = 4, ers: ERSConfig | None = None,
         limits: LayoutLimits | None = None, ra2p: RA2PConfig | None = None,
         eval_every: int = 0, eval_groups: int = 0, checkpoint_every: int = 0,
         tensor_parallel: int = 1) -> StepController:
    """A controller of ``system`` through the config its substrate would build
    (``effective_config``): groups of G, B_min one group, B_ideal ``batch`` samples."""
    job = JobShape(steps=steps, group_size=G, batch_groups=batch // G, batch_min_groups=1,
                   max_staleness=staleness, carry_versions=carry, eval_every=eval_every,
                   eval_groups=eval_groups)
    substrate = Substrate(kv_tokens=BUDGET, max_new_tokens=8, limits=limits or LayoutLimits(),
                          checkpoint_every=checkpoint_every, tensor_parallel=tensor_parallel)
    config = effective_config(SystemSpec(system), job, CTBConfig(budget_fraction=1.0),
                              ra2p or RA2PConfig(tokens_per_rank=1000),
                              ers or ERSConfig(cold_start_steps=0), substrate)
    return StepController(config, list(roles), source, now=0.0)


def feed(*ids: str, is_eval: bool = False, step: int = 0) -> FeedGroups:
    def index(group_id: str) -> int:
        return int(group_id.rsplit(".", 1)[-1]) if is_eval else int(group_id[1:])

    return FeedGroups(tuple(GroupSpec(g, index(g), is_eval, step) for g in ids), is_eval)


def outcome(step: int, *ranks: int, t: float = 1.0, loss: float = 0.5) -> StepOutcome:
    reports = tuple(RankReport(r, wait_s=0.25, t_ref=t, t_act_f=t, t_act_b=2 * t, t_swap=0.0,
                               loss=loss, grad_norm=1.5) for r in ranks)
    return StepOutcome(step, reports, kv_queries=10 * (step + 1), kv_hits=5 * (step + 1),
                       reward_mean=0.5)


def kinds(commands) -> list[str]:
    return [type(c).__name__ for c in commands]


def only(commands, kind):
    return [c for c in commands if isinstance(c, kind)]


def record_of(commands):
    (cmd,) = only(commands, RecordStep)
    return cmd.record


# --------------------------------------------------------------------------- a sync step


def test_a_sync_step_waits_for_its_whole_batch_then_every_rank_trains_it():
    c = make(System.SYNC, (R, R))
    assert c.launch(0.0) == [JoinRollout(0, BUDGET), JoinRollout(1, BUDGET), feed("g0", "g1")]
    assert c.state.phase is Phase.WAITING  # staleness 0: one batch, and the step waits for it all
    assert c.group_ready("g0", Ready("g0", 0), 1.0) == []
    out = c.group_ready("g1", Ready("g1", 0), 2.0)
    (mb,) = [d.mb for d in only(out, Dispatch)]  # 400 tokens <= 1000 x 2 ranks: one batch
    assert out == [StartStep(0, StepMode.BATCH, (), (0, 1), 0), Dispatch(0, 0, mb),
                   CloseStep(0)]
    assert len(mb.sequences) == 4
    out = c.step_done(outcome(0, 0, 1), 5.0)
    record = record_of(out)
    assert (record.trained_samples, record.trained_tokens, record.step_mode) == (4, 400,
                                                                          StepMode.BATCH)
    assert record.twt_s == 0.5  # the in-step waits; the ranks were rolling out before
    assert record.kv_hit_rate == 0.5 and record.loss == 0.5 and record.grad_norm == 1.5
    (boundary,) = only(out, Boundary)
    assert (boundary.version, boundary.members, boundary.src_rank, boundary.joiners) == (
        1, (0, 1), 0, ())
    assert not only(out, Retire)  # the window moves once every rank has version 1
    assert c.boundary_acked(0, 1, 6.0) == []
    assert c.boundary_acked(1, 1, 6.5) == [Retire(4, 8), feed("g2", "g3", step=1)]
    assert c.state.phase is Phase.WAITING and c.state.step == 1


# --------------------------------------------------------------------------- async, stale


def test_an_async_step_retires_a_stale_group_with_its_batch():
    c = make(System.ASYNC, (R, A), staleness=0)
    assert kinds(c.launch(0.0)) == ["JoinRollout", "FeedGroups"]
    c.group_ready("g0", Ready("g0", 0), 1.0)
    out = c.group_ready("g1", Ready("g1", 0), 2.0)
    assert only(out, StartStep) == [StartStep(0, StepMode.BATCH, (), (1,), 0)]
    out = c.step_done(outcome(0, 1), 4.0)
    assert record_of(out).twt_s == pytest.approx(0.25 + 2.0)  # waited 2 s for the batch
    assert only(out, Retire) == []
    assert c.boundary_acked(1, 1, 4.5) == []  # the actor: the rollout rank still syncs
    assert c.boundary_acked(0, 1, 5.0) == [Retire(4, 8), feed("g2", "g3", step=1)]
    assert c.state.phase is Phase.WAITING
    # g2 ran on version 0: one version too old for batch 1 at staleness 0
    out = c.group_ready("g2", Ready("g2", 0), 6.0)
    # its samples leave the window at once, and a group takes its place
    assert out == [GroupDropped("g2", "stale", 0, 1), Retire(2, 10), feed("g4", step=1)]
    c.group_ready("g3", Ready("g3", 1), 7.0)
    out = c.group_ready("g4", Ready("g4", 1), 8.0)
    assert kinds(out) == ["StartStep", "Dispatch", "CloseStep"]
    out = c.step_done(outcome(1, 1), 9.0)
    assert record_of(out).discarded_tokens_total == 200
    c.boundary_acked(1, 2, 9.5)
    out = c.boundary_acked(0, 2, 9.5)
    assert out[0] == Retire(4, 14)  # the 4 trained samples (the discarded ones left before)


def test_a_straggler_is_carried_past_the_bound_by_carry_versions_then_dropped():
    c = make(System.ASYNC, (R, A), staleness=0, carry=1)
    c.launch(0.0)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 2.0)
    c.step_done(outcome(0, 1), 4.0)
    c.boundary_acked(1, 1, 4.5)
    c.boundary_acked(0, 1, 5.0)
    # g2 ran on version 0: one version past the bound of batch 1, within the one it carries
    assert c.group_ready("g2", Ready("g2", 0), 6.0) == []
    out = c.group_ready("g3", Ready("g3", 1), 7.0)
    assert kinds(out) == ["StartStep", "Dispatch", "CloseStep"]
    assert {s.seq_id for s in only(out, Dispatch)[0].mb.sequences} == {
        task_id(g, i) for g in ("g2", "g3") for i in range(G)}
    out = c.step_done(outcome(1, 1), 9.0)
    assert record_of(out).staleness_max == 1 and record_of(out).discarded_tokens_total == 0
    c.boundary_acked(1, 2, 9.5)
    c.boundary_acked(0, 2, 9.5)
    # a group of version 0 for batch 2 is two versions past the bound: dropped
    assert c.group_ready("g4", Ready("g4", 0), 10.0)[0] == GroupDropped("g4", "stale", 0, 2)
    assert make(System.SYNC, (R, A), staleness=0, carry=1).config.drop_staleness == 0


# --------------------------------------------------------------------------- ERS phases


def test_a_cold_start_lends_the_trainer_until_batch_0_is_ready_then_step_0_trains_on_all():
    c = make(roles=(R, A, A), ers=ERSConfig(cold_start_steps=1))
    out = c.launch(0.0)
    (boundary,) = only(out, Boundary)
    assert boundary.roles == (R, A, R) and boundary.reason is PlanReason.COLD_START
    assert (boundary.version, boundary.joiners, boundary.src_rank) == (0, (), 1)
    assert only(out, JoinRollout) == [JoinRollout(0, BUDGET)]  # rank 2 once its engine is up
    assert c.boundary_acked(0, 0, 0.1) == c.boundary_acked(1, 0, 0.1) == []
    assert c.boundary_acked(2, 0, 0.2) == [JoinRollout(2, BUDGET)]
    assert c.state.phase is Phase.WAITING  # no step opens on the trainer's minimum
    decisions = c.schedule(0.3)
    assert decisions == [Admit(task_id("g0", 0), 0), Admit(task_id("g1", 0), 2)]
    assert c.group_ready("g0", Ready("g0", 0, tokens=600), 1.0) == []
    # batch 0 is ready: the lent rank comes back (a boundary without an update) before step 0
    out = c.group_ready("g1", Ready("g1", 0, tokens=600), 2.0)
    assert out[0] == LeaveRollout(2, (task_id("g1", 0),))
    (boundary,) = only(out, Boundary)
    assert (boundary.version, boundary.roles, boundary.old_roles) == (0, (R, A, A), (R, A, R))
    assert boundary.joiners == (2,) and boundary.reason is PlanReason.PHASE_END
    assert c.boundary_acked(0, 0, 2.1) == c.boundary_acked(1, 0, 2.1) == []
    out = c.boundary_acked(2, 0, 2.2)
    # the micro-batches formed for one actor (1200 tokens each, 1000 per rank) are cut again
    # for two: 2400 tokens over 2 ranks, the smallest last, each ready when its last sequence was
    assert kinds(out) == ["StartStep", "Dispatch", "Dispatch", "CloseStep"]
    assert out[0] == StartStep(0, StepMode.COLOCATED, (), (1, 2), 8)
    assert [(d.mb.ready_time, [s.seq_id for s in d.mb.sequences]) for d in out[1:3]] == [
        (2.0, [task_id("g1", 1), task_id("g1", 0)]), (1.0, [task_id("g0", 0), task_id("g0", 1)])]
    out = c.step_done(outcome(0, 1, 2), 3.0)
    record = record_of(out)
    assert (record.ers_reason, record.roles, record.num_trainer) == (
        "phase_end", ("rollout", "actor", "actor"), 2)


def test_micro_batches_are_cut_for_the_model_replicas_under_tensor_parallelism():
    # two actors that hold one TP = 2 replica train as one data-parallel rank
    for tp in (1, 2):
        c = make(System.TIDERL, (R, R, A, A), tensor_parallel=tp,
                 ers=ERSConfig(enabled=False))
        c.launch(0.0)
        assert c.buffer.num_dp_ranks == 2 // tp
        dispatched = []
        for i in range(4):
            out = c.group_ready(f"g{i}", Ready(f"g{i}", 0, tokens=600), 1.0 + i)
            dispatched += [d.mb for d in only(out, Dispatch)]
        # formed as for the other tests' one rank (a group, then the last two one by one) when
        # the two actors are one replica; for two data-parallel ranks without TP
        assert [len(mb.sequences) for mb in dispatched] == ([2, 2] if tp == 1 else [2, 1, 1])


def test_micro_batches_wait_for_their_step_and_are_cut_for_its_actor_ranks():
    # stream: batch 1 arrives while step 0 trains on rank 2 alone; a manual plan then gives
    # the trainer two ranks, so step 1 takes batch 1 cut for two
    c = make(System.TIDERL, (R, R, A), ers=ERSConfig(enabled=False))
    c.launch(0.0)
    c.group_ready("g0", Ready("g0", 0, tokens=600), 1.0)
    c.group_ready("g1", Ready("g1", 0, tokens=600), 1.5)
    c.group_ready("g2", Ready("g2", 0, tokens=600), 2.0)
    c.group_ready("g3", Ready("g3", 0, tokens=600), 2.5)
    # formed for one rank (1000 tokens each): a group, then the batch's last two one by one
    assert [len(mb.sequences) for mb in c.steps.waiting[1]] == [2, 1, 1]
    c.submit_manual(ManualRequest("k", 1, 2), 2.6)
    out = c.step_done(outcome(0, 2), 3.0)
    assert only(out, Boundary)[0].roles == (R, A, A)
    for rank in range(3):
        out = c.boundary_acked(rank, 1, 3.5)
    assert kinds(out) == ["StartStep", "Dispatch", "Dispatch", "CloseStep"]
    assert out[0] == StartStep(1, StepMode.COLOCATED, (), (1, 2), 8)
    dispatched = [d.mb for d in only(out, Dispatch)]  # 2400 tokens, 2000 per micro-batch
    assert [([s.seq_id for s in mb.sequences], mb.ready_time) for mb in dispatched] == [
        ([task_id("g3", 1), task_id("g3", 0)], 2.5), ([task_id("g2", 0), task_id("g2", 1)], 2.0)]


def test_an_evaluation_phase_lends_ranks_until_its_groups_are_back():
    c = make(roles=(R, A, A), eval_every=2, eval_groups=1)
    out = c.launch(0.0)
    assert only(out, Boundary)[0].reason is PlanReason.EVALUATION
    assert only(out, FeedGroups)[-1] == feed("e0.0", is_eval=True)
    for rank in range(3):
        c.boundary_acked(rank, 0, 0.1)
    c.group_ready("e0.0", None, 0.5)  # the evaluation is back: it is never trained
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 1.5)
    out = c.step_done(outcome(0, 1), 2.0)
    assert only(out, Boundary)[0].reason is PlanReason.PHASE_END
    for rank in range(3):
        c.boundary_acked(rank, 1, 2.5)
    # a streaming step trains B_ideal even when little is ready at its boundary
    assert c.group_ready("g2", Ready("g2", 1), 3.0) == []
    out = c.group_ready("g3", Ready("g3", 1), 3.2)
    assert kinds(out) == ["Dispatch", "CloseStep"]
    out = c.step_done(outcome(1, 1, 2), 4.0)  # step 2 is due for an evaluation
    assert record_of(out).batch_size == 2 * G
    assert only(out, Boundary)[0].reason is PlanReason.EVALUATION
    acks = [c.boundary_acked(rank, 2, 4.5) for rank in range(3)]
    assert kinds(acks[-1]) == ["JoinRollout", "Retire", "FeedGroups", "FeedGroups", "StartStep"]
    assert acks[-1][3] == feed("e2.0", is_eval=True, step=2)
    assert c.feed.count.as_dict() == {"fed": 8, "trained": 4, "dropped": 0, "buffered": 0,
                                  "rolling_out": 4}  # evaluation groups are not counted


def test_an_evaluation_holds_the_next_weight_sync_until_its_groups_are_back():
    c = make(System.STREAM, (R, A), eval_every=2, eval_groups=1)
    assert only(c.launch(0.0), FeedGroups)[-1] == feed("e0.0", is_eval=True)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 1.5)
    # step 0 is done while its evaluation still runs on version 0: no weight sync yet
    assert kinds(c.step_done(outcome(0, 1), 2.0)) == ["RecordStep"]
    assert c.state.phase is Phase.BOUNDARY and c.boundaries.pending is None
    (boundary,) = c.group_ready("e0.0", None, 3.0)
    assert (type(boundary), boundary.version) == (Boundary, 1)


def test_a_sync_step_trains_once_its_evaluation_is_done():
    c = make(System.SYNC, (R, R), eval_every=2, eval_groups=1)
    c.launch(0.0)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    assert c.group_ready("g1", Ready("g1", 0), 1.5) == []  # the batch is in, the eval is not
    assert c.state.phase is Phase.WAITING
    out = c.group_ready("e0.0", None, 3.0)
    assert kinds(out) == ["StartStep", "Dispatch", "CloseStep"]


# --------------------------------------------------------------------------- dead ranks


def test_a_dead_rollout_rank_leaves_the_boundary_and_its_tasks_go_back_to_ctb():
    c = make(System.STREAM, (R, R, A))
    c.launch(0.0)
    admitted = c.schedule(0.1)
    on_one = tuple(d.task_id for d in admitted if d.rank == 1)
    assert on_one  # two probes, one per rank
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 1.5)
    out = c.step_done(outcome(0, 2), 2.0)
    assert only(out, Boundary)[0].members == (0, 1, 2)
    c.boundary_acked(0, 1, 2.5)
    c.boundary_acked(2, 1, 2.5)
    out = c.rank_dead(1, "missed heartbeats", 3.0)
    assert out[0] == LeaveRollout(1, on_one, is_dead=True)
    assert kinds(out) == ["LeaveRollout", "Retire", "FeedGroups", "StartStep"]
    assert c.state.roles == [R, IDLE, A] and 1 not in c.rollout.book.ranks
    assert c.rollout.book.tasks[on_one[0]].rank is None  # paused with no rank: resumed elsewhere
    assert c.rank_dead(1, "again", 3.5) == []
    assert c.rank_dead(2, "its bus connection is gone", 4.0) == [
        Abort("trainer rank 2 is gone (its bus connection is gone); it was the last actor "
              "that held the model and optimizer state")]


def test_a_failed_group_frees_the_staleness_window_at_once():
    """At staleness 0 the window holds one batch: if a failed group's samples left it only at
    the next boundary, the batch they were to fill could never complete (the job hung)."""
    c = make(System.ASYNC, (R, A), staleness=0, batch=4)
    c.launch(0.0)
    out = c.group_ready("g0", None, 1.0)  # a task of g0 produced no turn
    assert out == [GroupDropped("g0", "a task produced no turn", None, 0), Retire(2, 6),
                   feed("g2")]
    c.group_ready("g1", Ready("g1", 0), 2.0)
    out = c.group_ready("g2", Ready("g2", 0), 3.0)
    assert kinds(out)[:1] == ["StartStep"]  # batch 0 completes with the replacement


def test_the_last_rollout_rank_dying_closes_the_batch_and_a_trainer_rank_moves_to_rollout():
    c = make(System.STREAM, (R, A, A), steps=4, batch=4)
    c.launch(0.0)
    c.group_ready("g0", Ready("g0", 0), 1.0)  # half of batch 0: the step streams it
    out = c.rank_dead(0, "missed heartbeats", 2.0)
    assert kinds(out) == ["LeaveRollout", "Dispatch", "CloseStep"]  # closed with 2 samples
    out = c.step_done(outcome(0, 1, 2), 3.0)
    assert record_of(out).trained_samples == 2
    (boundary,) = only(out, Boundary)
    assert boundary.roles == (IDLE, A, R) and boundary.reason is PlanReason.NO_ROLLOUT
    c.boundary_acked(1, 1, 3.5)
    out = c.boundary_acked(2, 1, 3.5)
    assert JoinRollout(2, BUDGET) in out and c.rollout_ranks() == [2]


def test_the_last_rollout_rank_dying_with_an_empty_streaming_step_open_runs_it_again():
    """Step 0 is open on a batch with no group: it is aborted; once its actors report that none
    updated, a boundary without an update moves a trainer rank to rollout, and the step runs
    again (attempt 1) once that boundary is taken."""
    c = make(System.STREAM, (R, A, A), steps=4)
    c.launch(0.0)
    out = c.rank_dead(0, "missed heartbeats", 2.0)
    assert out[-1] == AbortStep(0, 0)
    assert only(out, Abort) == []
    failed = StepOutcome(0, (RankReport(1, failed=True), RankReport(2, failed=True)))
    out = c.step_done(failed, 2.5)
    (boundary,) = only(out, Boundary)
    assert (boundary.version, boundary.roles, boundary.reason) == (0, (IDLE, A, R),
                                                                   PlanReason.NO_ROLLOUT)
    assert only(out, RecordStep) == []
    c.boundary_acked(1, 0, 3.0)
    out = c.boundary_acked(2, 0, 3.0)
    assert JoinRollout(2, BUDGET) in out
    (again,) = only(out, StartStep)
    assert (again.step, again.attempt, again.actor_ranks) == (0, 1, (1,))


def test_the_last_rollout_rank_dying_before_its_batch_moves_a_trainer_rank_at_once():
    c = make(System.ASYNC, (R, A, A), steps=4)  # whole batches: step 0 waits for its batch
    c.launch(0.0)
    out = c.rank_dead(0, "missed heartbeats", 1.0)
    (boundary,) = only(out, Boundary)  # no update: the roles only
    assert (boundary.version, boundary.roles, boundary.reason) == (0, (IDLE, A, R),
                                                                   PlanReason.NO_ROLLOUT)
    c.boundary_acked(1, 0, 1.5)
    assert JoinRollout(2, BUDGET) in c.boundary_acked(2, 0, 1.5)
    assert c.rollout_ranks() == [2] and c.state.phase is Phase.WAITING


def test_a_resumed_controller_goes_on_from_the_checkpoint_boundary():
    """Ready groups come back in ready order with their samples, groups in flight run again,
    the feed goes on at the same index, and the rollout ranks join once they have the weights."""
    c = make(System.STREAM, (R, A), steps=6, staleness=1, batch=4, checkpoint_every=1)
    c.launch(0.0)
    for g in ("g0", "g1"):
        c.group_ready(g, Ready(g, 0), 1.0)
    c.group_ready("g2", Ready("g2", 0), 1.5)  # ready for batch 1; g3 still rolls out
    out = c.step_done(outcome(0, 1), 2.0)
    (boundary,) = only(out, Boundary)
    assert boundary.checkpoint
    point = resume_point(c, 2.0)
    assert (point.version, point.ready, [s.group_id for s in point.in_flight],
            point.num_fed) == (1, ("g2",), ["g3"], 4)
    fresh = make(System.STREAM, (R, A), steps=6, staleness=1, batch=4, checkpoint_every=1)
    out = restore(fresh, point, [Ready("g2", 0)], 10.0)
    (boundary,) = only(out, Boundary)
    assert (boundary.version, boundary.roles, boundary.checkpoint) == (1, (R, A), False)
    assert only(out, FeedGroups) == [FeedGroups((GroupSpec("g3", 3, False, 0),), False)]
    assert fresh.rollout_ranks() == [0] and 0 not in fresh.rollout.book.ranks  # joins after its ack
    assert fresh.state.t0 == 8.0  # the job's clock goes on from the boundary's 2 s
    fresh.boundary_acked(1, 1, 10.5)
    out = fresh.boundary_acked(0, 1, 11.0)
    assert JoinRollout(0, BUDGET) in out
    assert only(out, Retire) == [Retire(4, 12)] and only(out, FeedGroups) == [feed("g4", "g5",
                                                                               step=1)]
    out = fresh.group_ready("g3", Ready("g3", 1), 12.0)  # batch 1: g2 (restored) and g3
    assert kinds(out) == ["Dispatch", "CloseStep"]
    out = fresh.step_done(outcome(1, 1), 13.0)
    assert fresh.feed.count.trained_ids == {"g0", "g1", "g2", "g3"}
    assert record_of(out).trained_tokens_total == 800


# --------------------------------------------------------------------------- manual plans


def test_a_manual_plan_applies_at_the_next_boundary_and_holds_until_released():
    c = make(roles=(R, A, A), steps=6)
    c.launch(0.0)
    c.boundary_acked(0, 0, 0.0), c.boundary_acked(1, 0, 0.0), c.boundary_acked(2, 0, 0.0)
    refused = c.submit_manual(ManualRequest("a", 2, 2), 0.5)
    assert refused == [ManualReply(ManualRequest("a", 2, 2), "a", "refused", 0,
                                   reason="--rollout 2 + --trainer 2 = 4, but the job has 3 "
                                          "live ranks")]
    request = ManualRequest("b", 2, 1)
    assert c.submit_manual(request, 0.6) == [
        ManualReply(request, "b", "accepted", 0, roles=(R, A, R),
                    placement=Placement.COLOCATED)]
    newer = ManualRequest("c", 1, 2, Placement.DECOUPLED)
    out = c.submit_manual(newer, 0.7)
    assert out[0] == ManualReply(request, "b", "refused", 0,
                                 reason="replaced by a newer manual plan (R1/T2 decoupled)")
    assert out[1].status == "accepted" and out[1].roles == (R, A, F)
    for step in range(2):
        c.group_ready(f"g{2 * step}", Ready(f"g{2 * step}", step), step + 1.0)
        c.group_ready(f"g{2 * step + 1}", Ready(f"g{2 * step + 1}", step), step + 1.5)
        out = c.step_done(outcome(step, *c.steps.current.start.ranks), step + 1.8)
        (boundary,) = only(out, Boundary)
        if step == 0:
            assert boundary.reason is PlanReason.MANUAL and boundary.roles == (R, A, F)
            assert only(out, ManualReply)[0].status == "applied"
        else:  # held: no ERS plan, the same roles
            assert boundary.reason is None and boundary.roles == (R, A, F)
        for rank in range(3):
            out = c.boundary_acked(rank, step + 1, step + 1.9)
        assert only(out, StartStep)[0] == StartStep(step + 1, StepMode.DECOUPLED, (2,), (1,), 1)
    (reply,) = c.release_manual("d", 3.0)
    assert (reply.status, reply.was_held, reply.reason) == (
        "released", True, "ERS plans again from the next boundary")
    assert not c.manual.is_held and c.manual.pending is None


def test_sync_systems_and_the_last_step_refuse_manual_plans():
    sync = make(System.SYNC, (R, R))
    (reply,) = sync.release_manual("a", 0.0)
    assert reply.reason == "system sync: every rank rolls out and trains"
    last = make(roles=(R, A, A), steps=1)
    (reply,) = last.submit_manual(ManualRequest("a", 2, 1), 0.0)
    assert reply.reason.startswith("the job is finishing: step 0 is its last")


def test_the_layout_limits_refuse_a_plan_and_keep_the_roles():
    c = make(roles=(R, A, A), ers=ERSConfig(cold_start_steps=1),
             limits=LayoutLimits(fixed_actor_backend="megatron"))
    out = c.launch(0.0)
    assert kinds(out)[0] == "PlanRefused"
    assert only(out, Boundary)[0].roles == (R, A, A)


# --------------------------------------------------------------------------- rules


def test_footprints_are_the_context_plus_a_whole_generation():
    c = make(System.TIDERL, (R, A), ers=ERSConfig(enabled=False))
    c.launch(0.0)
    probe = c.schedule(0.0)[0]
    c.rollout.turn_done(probe.task_id, 40, 5, 1.0)
    task = c.rollout.book.tasks[probe.task_id]
    assert (task.footprint, task.context_len, task.is_running) == (48, 40, False)
    assert c.rollout.generated_tokens == 5
    assert c.rollout.book.tasks[task_id("g0", 1)].footprint == 48  # the probe's siblings follow it
    c.rollout.turn_started(probe.task_id, 2.0)
    assert c.rollout.book.tasks[probe.task_id].is_running


def test_a_steps_kv_retention_is_what_its_turns_found_of_what_they_left():
    c = make(System.SYNC, (R, R))
    c.launch(0.0)
    c.schedule(0.0)
    c.rollout.turn_done(task_id("g0", 0), 100, 4, 0.5, reused=48, reusable=64)
    c.rollout.turn_done(task_id("g0", 0), 120, 4, 0.6, reused=64, reusable=96)
    c.rollout.turn_done("nowhere.0", 50, 4, 0.7, reused=0, reusable=32)  # not placed
    with pytest.raises(ValueError, match="reused 65 of 64"):
        c.rollout.turn_done(task_id("g0", 0), 130, 4, 0.8, reused=65, reusable=64)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 2.0)
    assert record_of(c.step_done(outcome(0, 0, 1), 5.0)).kv_retention == 112 / 160
    c.boundary_acked(0, 1, 6.0)
    c.boundary_acked(1, 1, 6.5)
    c.schedule(6.5)
    for g in ("g2", "g3"):
        c.group_ready(g, Ready(g, 1), 7.0)
    assert record_of(c.step_done(outcome(1, 0, 1), 8.0)).kv_retention is None  # none since


def test_rwt_counts_idle_rollout_only_while_the_throttle_holds_tasks_back():
    c = make(System.STREAM, (R, A), batch=2, staleness=0)  # one group fits the window
    c.launch(0.0)
    c.schedule(0.0)  # the probe goes out; its sibling waits for the probe's footprint
    c.rollout.turn_done(task_id("g0", 0), 10, 2, 1.0)
    c.schedule(1.0)
    assert c.rollout.book.num_new == 0
    assert c.rollout.rwt.total == 0.0  # a task waited for admission until now
    c.rollout.turn_done(task_id("g0", 1), 10, 2, 2.0)
    c.rollout.task_finished(task_id("g0", 0), 3.0)
    c.rollout.task_finished(task_id("g0", 1), 3.0)
    assert c.rollout.rwt.total == pytest.approx(1.0)  # idle from 2.0, nothing left to admit
    c.rollout.stalled(3.0, 4.0, 1)
    c.rollout.advance(4.0)
    assert c.rollout.rwt.total == pytest.approx(2.0)  # the stall, not counted twice


def test_a_step_that_is_not_open_is_refused():
    c = make(System.STREAM, (R, A))
    c.launch(0.0)
    with pytest.raises(StepControlError, match="step 3 is not the open step"):
        c.step_done(outcome(3, 1), 1.0)


def test_the_last_step_ends_with_a_final_boundary():
    c = make(System.STREAM, (R, A), steps=1)
    c.launch(0.0)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 2.0)
    out = c.step_done(outcome(0, 1), 3.0)
    assert kinds(out) == ["RecordStep", "Boundary", "Finish"]
    assert only(out, Boundary)[0].is_final and only(out, Boundary)[0].checkpoint
    assert out[-1] == Finish(1) and c.state.phase is Phase.FINISHED
    assert c.feed.count.as_dict() == {"fed": 4, "trained": 2, "dropped": 0, "buffered": 0,
                                  "rolling_out": 2}


def test_without_ers_ra2p_chooses_each_step_from_the_measured_pass_times():
    """Nothing measured: colocated, on the actor ranks (the Ref rank waits). Measured swaps of
    5 s against 0.4 s of compute per micro-batch, and two micro-batches ready (a sequence per
    actor rank each): decoupled."""
    c = make(roles=(R, F, A, A), ers=ERSConfig(enabled=False),
             ra2p=RA2PConfig(tokens_per_rank=50))
    c.launch(0.0)
    assert c.steps.current.start == StartStep(0, StepMode.COLOCATED, (), (2, 3), 8)
    for i in range(4):  # batch 0, then batch 1 ready before step 0 ends
        c.group_ready(f"g{i}", Ready(f"g{i}", 0), 1.0 + i)
    reports = tuple(RankReport(r, t_ref=0.1, t_act_f=0.1, t_act_b=0.2, t_swap=5.0)
                    for r in (2, 3))
    c.step_done(StepOutcome(0, reports), 6.0)
    out = [c.boundary_acked(rank, 1, 6.5) for rank in range(4)][-1]
    assert only(out, StartStep) == [StartStep(1, StepMode.DECOUPLED, (1,), (2, 3), 1)]
    assert c.steps.current.ras == 2


def test_a_layout_not_measured_is_costed_from_the_other_with_the_ref_share_scaled():
    colocated = {Placement.COLOCATED: MeasuredPasses(Ra2pTimings(1.0, 2.0, 4.0, 0.5), 4, 4)}
    # one Ref rank for three actors computes three actors' worth of each micro-batch
    assert layout_timings(colocated, Placement.DECOUPLED, 1, 3) == Ra2pTimings(3.0, 2.0, 4.0, 0.5)
    assert layout_timings(colocated, Placement.COLOCATED, 0, 2) == Ra2pTimings(1.0, 2.0, 4.0, 0.5)
    decoupled = {Placement.DECOUPLED: MeasuredPasses(Ra2pTimings(3.0, 2.0, 4.0, 0.0), 1, 3)}
    assert layout_timings(decoupled, Placement.COLOCATED, 1, 3) == Ra2pTimings(1.0, 2.0, 4.0, 0.0)
    assert layout_timings({}, Placement.DECOUPLED, 1, 3) is None


def test_a_refused_plan_leaves_ers_as_it_was():
    c = make(roles=(R, A, A), ers=ERSConfig(cold_start_steps=1),
             limits=LayoutLimits(fixed_actor_backend="megatron"))
    c.launch(0.0)  # the cold start's move is refused: no phase layout to restore later
    assert c.ers.state.saved_roles is None


def test_checkpoints_are_asked_at_their_versions_not_at_launch():
    c = make(System.STREAM, (R, A), steps=4, checkpoint_every=1)
    assert not only(c.launch(0.0), Boundary)  # no launch plan without ERS
    c = make(roles=(R, A, A), ers=ERSConfig(cold_start_steps=1),
             checkpoint_every=1)
    (launch,) = only(c.launch(0.0), Boundary)
    assert (launch.version, launch.checkpoint) == (0, False)
    for rank in range(3):
        c.boundary_acked(rank, 0, 0.0)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    (restore,) = only(c.group_ready("g1", Ready("g1", 0), 1.0), Boundary)  # the cold start ends
    assert (restore.version, restore.checkpoint) == (0, False)
    for rank in range(3):
        c.boundary_acked(rank, 0, 1.5)
    (boundary,) = only(c.step_done(outcome(0, 1, 2), 2.0), Boundary)
    assert (boundary.version, boundary.checkpoint) == (1, True)


def test_the_launch_layout_has_a_ref_rank_only_where_ra2p_runs():
    tiderl, no_ra2p = SystemSpec(System.TIDERL), SystemSpec(System.TIDERL, ra2p=False)
    assert initial_roles(tiderl, 4, 2, "decoupled") == [R, R, F, A]
    assert initial_roles(no_ra2p, 4, 2, "decoupled") == [R, R, A, A]
    assert initial_roles(SystemSpec(System.ASYNC), 4, 2, "decoupled") == [R, R, A, A]
    assert initial_roles(SystemSpec(System.SYNC), 4, 2, "auto") == [R, R, R, R]


def test_after_a_release_without_ers_no_plan_reason_is_reported():
    c = make(roles=(R, A, A), ers=ERSConfig(enabled=False))
    c.launch(0.0)
    c.submit_manual(ManualRequest("a", 2, 1), 0.1)
    c.group_ready("g0", Ready("g0", 0), 1.0)
    c.group_ready("g1", Ready("g1", 0), 1.0)
    c.step_done(outcome(0, 1, 2), 2.0)
    assert c.state.plan_reason is PlanReason.MANUAL and c.manual.is_held
    c.release_manual("b", 2.5)
    assert c.state.plan_reason is None


def test_occupancy_counts_full_ranks_while_tasks_wait_and_the_generating_task_time():
    rollout = RolloutControl.of(CTBConfig(), budget=600, max_new_tokens=8)  # one 512 task a rank
    for rank in (0, 1):
        rollout.add_rank(rank, 0.0)
    for g in range(3):
        rollout.add_group(source(GroupSpec(f"g{g}", g, False, 0)), 0.0)
    assert len(rollout.schedule(0.0)) == 2 and rollout.book.num_new == 4
    rollout.advance(2.0)
    assert rollout.saturated_s == pytest.approx(4.0)  # two full ranks for 2 s
    rollout.turn_done("g0.0", 100, 4, 2.0)  # g0.0 now waits for its environment
    rollout.advance(3.0)
    assert rollout.interval() == pytest.approx((0.0, 6.0, 5 / 6))  # generating 2+2+1 of 6
    rollout.park(3.0, True)  # a synchronous system's ranks train: not rollout's bound
    rollout.advance(4.0)
    assert rollout.interval() == (0.0, 0.0, None)


def test_an_engine_that_reports_its_own_kv_capacity_gets_that_share_as_its_budget():
    """An engine server sizes its own KV cache: CTB admits against what the engine reports
    (``budget_fraction`` of it), on a rollout rank at once and on a trainer rank once it joins."""
    c = make(System.TIDERL, (R, A))
    c.launch(0.0)
    assert c.rollout.budgets() == {0: BUDGET}
    fraction = c.config.ctb.budget_fraction
    assert c.engine_capacity(0, 4000, 0.1) == []
    assert c.rollout.budgets() == {0: int(4000 * fraction)}
    c.engine_capacity(1, 2000, 0.2)  # not a rollout rank yet: kept for when it joins
    assert c.rollout.budgets() == {0: int(4000 * fraction)}
    c.rollout.add_rank(1, 0.3)
    assert c.rollout.budgets() == {0: int(4000 * fraction), 1: int(2000 * fraction)}
    c.engine_capacity(0, 0, 0.4)  # no capacity reported: the budget stays
    assert c.rollout.budgets()[0] == int(4000 * fraction)
    assert c.rollout.book.prefill_tokens_per_s == {}  # no prefill measured yet
    c.engine_capacity(0, 4000, 0.5, prefill_tokens_per_s=2500.0)
    assert c.rollout.book.prefill_tokens_per_s == {0: 2500.0}
