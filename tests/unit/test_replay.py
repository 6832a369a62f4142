"""A replay (``runtime.replay``) below a job: what it refuses (a recording of another shape,
too few steps; a profile that would not train or would roll out), its launch plan, and its step
cycle on hand-built recorded steps (exact commands)."""

from __future__ import annotations

import pytest

from tests.unit.test_recording import COLOCATED, profile, record_steps
from tiderl.core.commands import (
    Abort,
    Boundary,
    CloseStep,
    Dispatch,
    Finish,
    ManualRequest,
    RankReport,
    RecordStep,
    StartStep,
    StepOutcome,
)
from tiderl.core.config import ConfigError
from tiderl.core.step_control import Phase
from tiderl.core.step_control.replay import ReplayController, ReplayStep
from tiderl.core.system import StepMode
from tiderl.core.types import MicroBatch, Role, SeqRef
from tiderl.launch.plan import plan_local
from tiderl.runtime.recording import RecordingError, check_recording
from tiderl.runtime.step_config import profile_step_config

A, F, R, IDLE = Role.ACTOR, Role.REF, Role.ROLLOUT, Role.IDLE


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("extra", "expected"), [
    (["job.steps=3"], "has no recorded step 2 of the 3 this job trains (it holds steps 0-1; "
                      "job.steps sets how many)"),
    (["job.group_size=4"], "step 0 was recorded with job.group_size 2, this job has 4"),
    (["model.seed=1"], "step 0 was recorded with model random-init tiny seed 0 float32, this "
                       "job has random-init tiny seed 1 float32"),
    (["runtime.num_ranks=4"], "step 0 was recorded with runtime.num_ranks 3, this job has 4"),
    (["runtime.system=stream"], "step 0 was recorded with runtime.system tiderl, this job has "
                                "stream"),
])
def test_a_replay_refuses_a_recording_it_cannot_reproduce(tmp_path, extra, expected):
    record_steps(tmp_path / "batches", 2)
    assert check_recording(profile(f"runtime.replay={tmp_path}")) == tmp_path / "batches"
    with pytest.raises(RecordingError) as info:
        check_recording(profile(f"runtime.replay={tmp_path}", *extra))
    assert str(info.value) == f"{tmp_path / 'batches'} {expected}"


def test_a_replay_that_would_not_train_or_would_roll_out_is_refused_by_the_profile():
    for extra, expected in [
            ("runtime.train=false", "runtime.train: expected true with runtime.replay (a replay "
                                    "trains its recording), got false"),
            ("engine.backend=http", "runtime.replay: a replay rolls out nothing and starts no "
                                    "engine server: set engine.backend=embedded (it is http)")]:
        with pytest.raises(ConfigError) as info:
            profile("runtime.replay=x", extra)
        assert str(info.value) == f"--set: {expected}"


def test_a_replay_plan_starts_no_environment_and_its_rollout_ranks_idle():
    plan = plan_local(profile("runtime.replay=x"))
    assert [p.kind for p in plan.processes] == ["coordinator", "rank", "rank", "rank"]
    assert [p.role for p in plan.ranks] == [IDLE, A, A]
    sync = plan_local(profile("runtime.replay=x", "runtime.system=sync",
                              "runtime.rollout_ranks=3"))
    assert [p.role for p in sync.ranks] == [R, R, R]  # each one trains too

# --------------------------------------------------------------------------- the cycle


def step_of(step: int, start: StartStep, *mbs: tuple[str, ...],
            loss: float | None = 0.5) -> ReplayStep:
    batches = tuple(MicroBatch(i, tuple(SeqRef(s, 10) for s in ids)) for i, ids in enumerate(mbs))
    groups = frozenset(s.rpartition(".")[0] for ids in mbs for s in ids)
    num = sum(len(ids) for ids in mbs)
    return ReplayStep(StartStep(step, start.step_mode, start.ref_ranks, start.actor_ranks,
                                start.max_aggregate), batches, groups, num, loss)


def replay(roles, *steps: ReplayStep) -> tuple[ReplayController, list[int]]:
    """A replay of ``steps``, and the steps it loaded so far, in order."""
    config = profile_step_config(profile(f"job.steps={len(steps)}"))
    loaded: list[int] = []

    def load(step: int) -> ReplayStep:
        loaded.append(step)
        return steps[step]

    return ReplayController(config, list(roles), lambda spec: None, load, now=0.0), loaded


def done(step: int, *ranks: int, loss: float = 0.5) -> StepOutcome:
    return StepOutcome(step, tuple(RankReport(r, loss=loss, loss_tokens=20) for r in ranks))


def test_a_replay_runs_each_step_on_its_recorded_layout_and_micro_batches():
    decoupled = StartStep(1, StepMode.DECOUPLED, (2,), (1,), 1)
    c, loaded = replay([IDLE, A, A],
                       step_of(0, COLOCATED, ("g0.0", "g0.1"), ("g1.0",), loss=0.25),
                       step_of(1, decoupled, ("g2.0",)))
    out = c.launch(0.0)  # the ranks hold step 0's layout already: it opens, whole, at once
    (first, second) = [d.mb for d in out if isinstance(d, Dispatch)]
    assert out == [COLOCATED, Dispatch(0, 0, first), Dispatch(0, 1, second), CloseStep(0)]
    assert [s.seq_id for s in first.sequences] == ["g0.0", "g0.1"] and loaded == [0]
    out = c.step_done(done(0, 1, 2, loss=0.5), 1.0)
    record = out[0].record
    assert (record.loss, record.recorded_loss, record.trained_samples, record.num_micro_batches,
            record.trained_tokens) == (0.5, 0.25, 3, 2, 30)
    (boundary,) = out[1:]  # step 1 was decoupled: rank 2 becomes its Ref first
    assert boundary == Boundary(1, (IDLE, A, F), (IDLE, A, A), (0, 1, 2), 1, (), None)
    assert c.state.phase is Phase.BOUNDARY and loaded == [0, 1]
    assert c.boundary_acked(1, 1, 1.1) == [] and c.boundary_acked(2, 1, 1.2) == []
    out = c.boundary_acked(0, 1, 1.3)
    assert out[0] == decoupled and out[-1] == CloseStep(1)
    out = c.step_done(done(1, 1, 2), 2.0)
    assert isinstance(out[0], RecordStep) and out[-1] == Finish(2)
    assert out[1] == Boundary(2, (IDLE, A, F), (IDLE, A, F), (0, 1, 2), 1, (), None,
                              checkpoint=False, export=True, is_final=True)
    assert c.state.phase is Phase.FINISHED
    assert c.feed.count.as_dict() == {"fed": 3, "trained": 3, "dropped": 0, "buffered": 0,
                                      "rolling_out": 0}
    assert c.schedule(2.0) == []  # nothing rolls out


def test_a_replay_hands_the_weights_on_when_two_steps_share_no_actor():
    on_rank = [StartStep(s, StepMode.COLOCATED, (), (rank,), 8) for s, rank in ((0, 2), (1, 1))]
    c, _ = replay([IDLE, IDLE, A], step_of(0, on_rank[0], ("g0.0",)),
                  step_of(1, on_rank[1], ("g1.0",)))
    assert c.launch(0.0)[0] == on_rank[0]
    (boundary,) = c.step_done(done(0, 2), 1.0)[1:]  # from rank 2, with its AdamW state to 1
    assert boundary == Boundary(1, (IDLE, A, IDLE), (IDLE, IDLE, A), (0, 1, 2), 2, (1,), None)


def test_a_replay_stops_when_a_rank_dies_and_refuses_an_operators_plan():
    c, _ = replay([IDLE, A, A], step_of(0, COLOCATED, ("g0.0",)))
    c.launch(0.0)
    (reply,) = c.submit_manual(ManualRequest("op", 1, 2), 0.5)
    assert (reply.status, reply.reason) == ("refused", "a replay runs the layout of its recording")
    assert c.rank_dead(2, "missed heartbeats", 1.0) == [Abort(
        "rank 2 is gone (missed heartbeats): a replay runs the layout of its recording, on "
        "every rank")]
