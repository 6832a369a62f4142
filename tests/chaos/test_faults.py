"""Kill or stop each process of a real job, as an operator would, and check what the docs
promise (docs/runtime.md, "Faults and resume"): the job goes on, or stops with the line that
resumes it, and after the resume every group is trained once or counted, and nothing is left.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.chaos.chaos_job import (
    assert_each_group_once,
    assert_nothing_left,
    chaos,
    checkpoint_of,
    events,
    kill,
    kill_job,
    launch,
    rank_log,
    roles_now,
    started,
    status_of,
    steps_done,
    wait_nothing_left,
)
from tests.tmpfs import small_tmpfs
from tiderl.launch.local import JobRecord, is_running, stop_processes
from tiderl.runtime.lineage import read_lineage

STEPS = 6


def resume_and_finish(jobs: list, run_root: Path, run_dir: Path) -> dict:
    resumed = launch(run_root, resume=run_dir.name)
    jobs.append(resumed)
    assert resumed.wait() == 0, resumed.output
    # each step once in the live lineage (the files also hold what the resume discarded)
    assert [m.step for m in read_lineage(run_dir).metrics] == list(range(STEPS))
    stop = assert_each_group_once(run_dir)
    assert stop["state"] == "ok" and stop["steps"] == STEPS
    assert_nothing_left(run_dir)
    return stop


def test_a_rollout_rank_killed_with_another_left_the_job_goes_on(tmp_path):
    """Declared dead (its bus connection is gone, or it misses heartbeats); its tasks start
    again on the other rank, the broadcasts leave it out (one it died in goes out again without
    it), its environment sessions are ended, and the job finishes its steps in bound."""
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, "runtime.num_ranks=4",
                                      "runtime.rollout_ranks=2", "ers.enabled=false")
        job.until(lambda: steps_done(run_dir) >= 1, "step 1")
        kill(state, "rank0")
        assert job.wait() == 0, job.output
        (dead,) = events(run_dir, "rank_dead")
        assert dead["rank"] == 0 and dead["role"] == "rollout"
        (ended,) = events(run_dir, "env_sessions_ended")  # not left to expire
        assert ended["rank"] == 0 and ended["ended"] is not None
        assert assert_each_group_once(run_dir)["steps"] == STEPS
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == list(range(STEPS))
        assert metrics[-1]["roles"][0] == "idle" and metrics[-1]["num_rollout"] == 1
        assert all(m["staleness_max"] <= 2 for m in metrics)  # max_staleness 1, carry 1
        assert_nothing_left(run_dir)


@pytest.mark.parametrize(("system", "opened"), [
    ("async", None),  # whole batches: killed after step 2, its batch may hold groups or none
    ("tiderl", "rank 1: step 2 attempt 0 opens"),  # killed once step 2 streams, its batch empty
], ids=["async", "streaming-step-open"])
def test_the_last_rollout_rank_killed_a_trainer_rank_takes_its_place(tmp_path, system, opened):
    """The open batch closes with what it holds and the next boundary moves a trainer rank to
    rollout; a streaming step open on a batch with no group is aborted and runs again after
    that boundary (turns wait 0.5 s for their environment: step 2's batch is still empty when
    it opens)."""
    with chaos(tmp_path) as jobs:
        slow = ("env.step_latency.median_s=0.5",) if opened else ()
        job, state, run_dir = started(jobs, tmp_path, "ers.enabled=false",
                                      f"runtime.system={system}", *slow)
        if opened:
            job.until(lambda: opened in rank_log(run_dir, 1), "step 2 open on rank 1")
        else:
            job.until(lambda: steps_done(run_dir) >= 2, "step 2")
        kill(state, "rank0")  # the one rollout rank
        assert job.wait() == 0, job.output
        (moved,) = [e for e in events(run_dir, "role_change") if e["dst"] == "rollout"]
        assert moved["reason"] == "no_rollout"
        assert assert_each_group_once(run_dir)["steps"] == STEPS
        assert_nothing_left(run_dir)


@pytest.mark.parametrize(("role", "sig", "extra"), [
    ("actor", signal.SIGKILL, ()),
    ("actor", signal.SIGSTOP, ()),  # past its heartbeats: stopped for good with the job
    ("ref", signal.SIGKILL, ("ra2p.placement=decoupled", "runtime.num_ranks=4")),
    ("ref", signal.SIGSTOP, ("ra2p.placement=decoupled", "runtime.num_ranks=4")),
    ("rollout", signal.SIGKILL, ("runtime.system=sync", "runtime.rollout_ranks=3")),  # a trainer
], ids=["actor-kill", "actor-stop", "ref-kill", "ref-stop", "sync-kill"])
def test_a_trainer_rank_killed_the_others_train_on_without_it(tmp_path, role, sig, extra):
    """Every DDP actor holds the whole model: the step the rank died in is trained once (by the
    actors left, again if they had not updated), and the job ends as planned."""
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, "ers.enabled=false", *extra, steps=8)
        job.until(lambda: steps_done(run_dir) >= 2, "step 2")  # its boundary is going out
        roles = roles_now(run_dir)
        victim = len(roles) - 1 - roles[::-1].index(role)
        kill(state, f"rank{victim}", sig)
        assert job.wait() == 0, job.output
        (dead,) = events(run_dir, "rank_dead")
        assert dead["rank"] == victim
        stop = assert_each_group_once(run_dir)
        assert stop["steps"] == 8
        assert roles_now(run_dir)[victim] == "idle"
        steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text()
                 .splitlines()]
        assert steps == list(range(8))  # each step once, none skipped
        assert_nothing_left(run_dir)
        assert status_of(tmp_path, run_dir) == "done"


def test_an_actor_killed_in_a_step_the_other_trains_it_again(tmp_path):
    """Turns that wait 0.5 s for their environment keep each streaming step open for seconds
    while its micro-batches come: an actor killed once a step is open leaves the other one
    waiting for data (AbortStep wakes it) or failing in the reduction; the step runs again on
    it alone (attempt 1) and trains once."""
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, "ers.enabled=false",
                                      "env.step_latency.median_s=0.5", steps=6)
        opened = "rank 2: step 2 attempt 0 opens"
        job.until(lambda: opened in rank_log(run_dir, 2), "step 2 open on rank 2")
        kill(state, "rank2")  # step 2 is open, waiting for its groups (turns take 0.5 s each)
        assert job.wait() == 0, job.output
        (again,) = [e for e in events(run_dir, "trained") if e["attempt"]]
        assert (again["step"], again["attempt"]) == (2, 1)
        assert assert_each_group_once(run_dir)["steps"] == 6
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(6))  # each step once, none skipped
        assert rows[2]["num_trainer"] == 1 and rows[-1]["roles"][2] == "idle"
        assert_nothing_left(run_dir)


def test_an_actor_killed_under_a_sharded_backend_stops_the_job_with_its_resume_line(tmp_path):
    """FSDP2: the dead actor's shards are lost; the job stops naming it (not a survivor's
    "connection closed") with the line that resumes it from its last checkpoint."""
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, "ers.enabled=false",
                                      "trainer.backend=fsdp2")
        job.until(lambda: checkpoint_of(run_dir, 2), "the checkpoint of step 2")
        victim = roles_now(run_dir).index("actor")
        kill(state, f"rank{victim}")
        killed_at = time.monotonic()
        assert job.wait() == 1
        assert time.monotonic() - killed_at < 60  # heartbeats, not a hang
        (line,) = [x for x in job.output.splitlines() if x.startswith("error:")]
        assert f"trainer rank {victim} is gone" in line and "shards the model" in line
        assert f"tiderl launch --resume {run_dir}" in line, line
        assert_nothing_left(run_dir)
        assert status_of(tmp_path, run_dir) == "failed"
        resume_and_finish(jobs, tmp_path, run_dir)


@pytest.mark.parametrize("mode", ["tiderl", "async"])
def test_the_whole_job_killed_resumes_from_its_checkpoint(tmp_path, mode):
    """async runs a batch ahead: its checkpoints hold ready groups, restored with their
    samples; tiderl streams them into the step, so its hold groups rolling out, run again."""
    with chaos(tmp_path) as jobs:
        ahead = ("runtime.num_ranks=4", "runtime.rollout_ranks=3", "job.max_staleness=2") \
            if mode == "async" else ()
        job, _, run_dir = started(jobs, tmp_path, f"runtime.system={mode}", *ahead)
        job.until(lambda: checkpoint_of(run_dir, 2), "the checkpoint of step 2")
        kill_job(JobRecord.load(run_dir))
        job.wait()
        wait_nothing_left(run_dir)
        stop = resume_and_finish(jobs, tmp_path, run_dir)
        (resume,) = events(run_dir, "resume")
        assert resume["version"] >= 2
        assert stop["groups"]["trained"] >= STEPS  # every step trained at least one group
        steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text()
                 .splitlines()]
        assert steps[-1] == STEPS - 1 and set(range(STEPS)) <= set(steps)


def test_a_corrupted_latest_checkpoint_falls_back_to_the_one_before(tmp_path):
    with chaos(tmp_path) as jobs:
        job, _, run_dir = started(jobs, tmp_path, steps=8)
        job.until(lambda: checkpoint_of(run_dir, 4), "the checkpoint of step 4")
        kill_job(JobRecord.load(run_dir))
        job.wait()
        shard = next((run_dir / "checkpoints" / "step-00000004").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # cut short
        resumed = launch(tmp_path, resume=run_dir.name)
        jobs.append(resumed)
        assert resumed.wait() == 0, resumed.output
        assert "passed over checkpoint step-00000004" in resumed.output
        (resume,) = events(run_dir, "resume")
        assert resume["version"] == 2
        assert_each_group_once(run_dir)
        assert_nothing_left(run_dir)


def test_the_coordinator_killed_the_ranks_exit_and_the_job_resumes(tmp_path):
    """The launcher goes too (kill -9 of both: no clean-up), so the ranks are on their own:
    each exits once its bus link has been down for a while."""
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path)
        job.until(lambda: checkpoint_of(run_dir, 2), "the checkpoint of step 2")
        os.killpg(job.proc.pid, signal.SIGKILL)
        kill(state, "coordinator")
        job.wait()
        ranks = [p for p in JobRecord.load(run_dir).processes if p.kind == "rank"]
        job_deadline = time.monotonic() + 90
        while any(is_running(p.pid) for p in ranks) and time.monotonic() < job_deadline:
            time.sleep(0.5)
        for rank in ranks:
            log = Path(rank.log).read_text()
            assert "no bus connection to the coordinator" in log, log[-2000:]
        stop_processes([p for p in state.processes if p.kind == "env"], grace_s=1.0)
        assert_nothing_left(run_dir)
        assert status_of(tmp_path, run_dir) == "crashed"
        resume_and_finish(jobs, tmp_path, run_dir)


def test_the_coordinator_stopped_past_the_ranks_patience_stops_the_job_resumable(tmp_path):
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path)
        job.until(lambda: checkpoint_of(run_dir, 2), "the checkpoint of step 2")
        kill(state, "coordinator", signal.SIGSTOP)
        ranks = [p for p in state.processes if p.kind == "rank"]
        job.until(lambda: not any(is_running(p.pid) for p in ranks), "the ranks gone",
                  timeout_s=90)  # each exits once its link to the coordinator is down 15 s
        kill(state, "coordinator", signal.SIGCONT)
        assert job.wait() == 1
        (line,) = [x for x in job.output.splitlines() if x.startswith("error:")]
        assert "is gone" in line and "--resume" in line, line
        assert_nothing_left(run_dir)
        resume_and_finish(jobs, tmp_path, run_dir)


def test_an_engine_server_killed_its_rank_goes_and_the_job_goes_on(tmp_path):
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, "runtime.num_ranks=4",
                                      "runtime.rollout_ranks=2", "ers.enabled=false",
                                      "engine.backend=http")
        job.until(lambda: steps_done(run_dir) >= 1, "step 1")
        kill(state, "engine0")
        assert job.wait() == 0, job.output
        (dead,) = events(run_dir, "rank_dead")
        assert dead["rank"] == 0
        assert_each_group_once(run_dir)
        assert_nothing_left(run_dir)


def test_an_engine_server_stopped_past_its_heartbeats_takes_its_rank_out(tmp_path):
    """SIGSTOP: its requests would wait out their timeout (minutes); its rank sees the server
    answer no heartbeat's stats for two heartbeat windows and goes, and the job goes on."""
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, "runtime.num_ranks=4",
                                      "runtime.rollout_ranks=2", "ers.enabled=false",
                                      "engine.backend=http")
        job.until(lambda: steps_done(run_dir) >= 1, "step 1")
        kill(state, "engine0", signal.SIGSTOP)
        job.until(lambda: events(run_dir, "rank_dead"), "rank 0 declared dead", timeout_s=90)
        kill(state, "engine0", signal.SIGCONT)
        assert job.wait() == 0, job.output
        (dead,) = events(run_dir, "rank_dead")
        assert dead["rank"] == 0
        log = (run_dir / "logs" / "rank0.log").read_text()
        assert "its engine server has not answered for" in log, log[-2000:]
        assert_each_group_once(run_dir)
        assert_nothing_left(run_dir)


def test_the_environment_service_killed_is_started_again(tmp_path):
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path)
        job.until(lambda: steps_done(run_dir) >= 1, "step 1")
        kill(state, "env")
        assert job.wait() == 0, job.output
        assert "starting it again (1 of 3)" in job.output
        stop = assert_each_group_once(run_dir)
        assert stop["steps"] == STEPS
        assert_nothing_left(run_dir)


def test_the_environment_service_stopped_past_its_deadline_drops_groups_not_the_job(tmp_path):
    """SIGSTOP longer than a call's deadline: the tasks in flight fail and their groups are
    dropped (and counted), the staleness window is freed at once, and the job goes on when the
    service does (no deadlock at staleness 0)."""
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, "job.max_staleness=0",
                                      "env.request_timeout_s=2", "env.call_deadline_s=4")
        job.until(lambda: steps_done(run_dir) >= 1, "step 1")
        kill(state, "env", signal.SIGSTOP)  # until the calls in flight fail past their deadline
        job.until(lambda: events(run_dir, "dropped_group"), "a group dropped")
        kill(state, "env", signal.SIGCONT)
        assert job.wait() == 0, job.output
        dropped = events(run_dir, "dropped_group")
        assert dropped and all(e["reason"] == "a task produced no turn" for e in dropped)
        assert assert_each_group_once(run_dir)["steps"] == STEPS
        assert_nothing_left(run_dir)


def test_a_rollout_rank_stopped_past_its_heartbeats_is_left_out_and_told_to_go(tmp_path):
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, "runtime.num_ranks=4",
                                      "runtime.rollout_ranks=2", "ers.enabled=false")
        job.until(lambda: steps_done(run_dir) >= 1, "step 1")
        kill(state, "rank0", signal.SIGSTOP)
        job.until(lambda: events(run_dir, "rank_dead"), "rank 0 declared dead", timeout_s=60)
        kill(state, "rank0", signal.SIGCONT)
        assert job.wait() == 0, job.output
        assert "this rank was declared dead" in (run_dir / "logs" / "rank0.log").read_text()
        assert_each_group_once(run_dir)
        assert_nothing_left(run_dir)


def test_ctrl_c_ends_the_job_as_interrupted_with_its_report_and_resumable(tmp_path):
    with chaos(tmp_path) as jobs:
        job, _, run_dir = started(jobs, tmp_path)
        job.until(lambda: checkpoint_of(run_dir, 2), "the checkpoint of step 2")
        os.kill(job.proc.pid, signal.SIGINT)
        assert job.wait() == 130
        assert "interrupted" in job.output and "Traceback" not in job.output
        assert_nothing_left(run_dir)
        (stop,) = events(run_dir, "stop")
        assert stop["state"] == "interrupted" and "--resume" in stop["resume"]
        assert "Ended: interrupted" in (run_dir / "report.md").read_text()
        assert status_of(tmp_path, run_dir) == "interrupted"
        resume_and_finish(jobs, tmp_path, run_dir)


def test_a_rank_killed_while_starting_fails_the_launch_naming_it(tmp_path):
    with chaos(tmp_path) as jobs:
        job, state, _ = started(jobs, tmp_path)  # every process started: no Hello yet
        kill(state, "rank1")
        killed_at = time.monotonic()
        assert job.wait() == 1
        assert time.monotonic() - killed_at < 30
        (line,) = [x for x in job.output.splitlines() if x.startswith("error:")]
        assert "rank1 exited with code -9" in line
        assert_nothing_left(Path(state.run_dir))


def test_a_full_disk_while_checkpointing_stops_the_job_resumable(tmp_path):
    with small_tmpfs(tmp_path / "small", "25m") as mount, chaos(mount) as jobs:
        # a checkpoint is ~17 MB: the second one does not fit
        job, _, run_dir = started(jobs, mount, steps=20)
        assert job.wait() == 1
        (line,) = [x for x in job.output.splitlines() if x.startswith("error:")]
        assert "no disk space for checkpoint step-00000004" in line, line
        assert "--resume" in line
        assert checkpoint_of(run_dir, 2)  # the complete one the line names
        assert_nothing_left(run_dir)


def test_a_rollout_rank_killed_while_agents_are_mid_task_the_job_goes_on(tmp_path):
    """Agent tasks (the OpenAI-SDK calc agent, 0.3 s of tool time a turn) on two rollout ranks;
    one is killed once both roll out: its sessions are ended (their agents stopped, their
    requests answered 409), its tasks start again on the other rank, and every group is trained
    once, dropped and counted, or left over."""
    from tiderl.models.random_init import write_random_checkpoint

    model = tmp_path / "model"
    write_random_checkpoint("tiny", model, tokenizer="bpe")
    agent = ["env.envs=[calc-openai]", "env.tasks={}", "env.options={}",
             'env.agents={calc-openai: {entry: "tiderl.examples.calc_openai:run"}}',
             "env.step_latency.kind=fixed", "env.step_latency.median_s=0.3",
             "engine.max_new_tokens=16", f"model.path={model}"]
    with chaos(tmp_path / "runs") as jobs:
        job, state, run_dir = started(jobs, tmp_path / "runs", "runtime.num_ranks=4",
                                      "runtime.rollout_ranks=2", "ers.enabled=false", *agent)
        job.until(lambda: steps_done(run_dir) >= 1, "step 1")
        kill(state, "rank0")
        assert job.wait() == 0, job.output
        (dead,) = events(run_dir, "rank_dead")
        assert dead["rank"] == 0 and dead["role"] == "rollout"
        (ended,) = events(run_dir, "env_sessions_ended")
        assert ended["rank"] == 0 and ended["ended"] is not None
        assert assert_each_group_once(run_dir)["steps"] == STEPS
        assert "Traceback" not in (run_dir / "logs" / "env.log").read_text()
        assert_nothing_left(run_dir)
