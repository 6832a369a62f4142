"""A rank killed inside a boundary, on purpose: the source of one version holds it back for a
while (``TIDERL_TEST_HOLD_BOUNDARY``), so its receivers sit inside their weight fetch, and the
test kills a rank there. A death costs the heartbeat window that names it, never a collective's
timeout: ``runtime.collective_timeout_s`` is 600 s here, beyond the test's patience, so any wait
for it fails the test. Each test prints what the death cost, from the job's logs."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from tests.chaos.chaos_job import (
    Launch,
    assert_each_group_once,
    assert_nothing_left,
    chaos,
    events,
    kill,
    rank_log,
    started,
    steps_done,
)
from tiderl.runtime.rank_trainer import HOLD_VAR

HELD_VERSION = 3  # the boundary after step 2
HOLD_S = 15.0
NO_COLLECTIVE_WAIT = "runtime.collective_timeout_s=600"
WINDOW_S = 0.5 * 6  # the chaos job's heartbeat window: heartbeat_s x (heartbeat_misses + 1)


def hold(monkeypatch, source: int) -> None:
    monkeypatch.setenv(HOLD_VAR, f"{source}:{HELD_VERSION}:{HOLD_S:g}")


def fetching(run_dir: Path, rank: int) -> bool:
    return f"rank {rank}: fetching version {HELD_VERSION}" in rank_log(run_dir, rank)


def holding(run_dir: Path, rank: int) -> bool:
    return f"rank {rank}: holding version {HELD_VERSION}" in rank_log(run_dir, rank)


def logged_at(text: str, needle: str) -> float:
    """The wall-clock time of the first log line holding ``needle`` (logging's asctime)."""
    line = next(x for x in text.splitlines() if needle in x)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def kill_inside(job: Launch, state, run_dir: Path, victim: int, source: int, what: str) -> None:
    """Kill ``victim``, wait for the step after the held boundary, print what the death cost:
    the time it took to be declared, and from then (or from the weights going out, when the
    source held them longer) to the next trained step."""
    kill(state, f"rank{victim}")
    killed_at = time.time()
    job.until(lambda: steps_done(run_dir) > HELD_VERSION, f"step {HELD_VERSION} trained")
    coordinator = (run_dir / "logs" / "coordinator.log").read_text()
    dead_at = logged_at(coordinator, "'kind': 'rank_dead'")
    trained_at = logged_at(coordinator, f"'kind': 'trained', 'step': {HELD_VERSION}")
    start = dead_at
    if victim != source:
        start = max(dead_at, logged_at(rank_log(run_dir, source), "holding version") + HOLD_S)
    print(f"\n{what}: declared dead {dead_at - killed_at:.1f} s after the kill (heartbeat "
          f"window {WINDOW_S:g} s); step {HELD_VERSION} trained {trained_at - start:.1f} s "
          "after that" + ("" if victim == source else " and the source's held weights"))


def went_on(job: Launch, run_dir: Path, victim: int, role: str) -> None:
    """The job finished its 6 steps with one death, ``victim``'s, and each group once."""
    assert job.wait() == 0, job.output
    (dead,) = events(run_dir, "rank_dead")
    assert (dead["rank"], dead["role"]) == (victim, role)
    assert assert_each_group_once(run_dir)["steps"] == 6
    assert_nothing_left(run_dir)


def assert_no_boundary_failed(job: Launch, run_dir: Path, survivors: list[int]) -> None:
    assert "could not take the boundary" not in job.output
    for rank in survivors:
        assert "stalled" not in rank_log(run_dir, rank)


def test_a_rollout_rank_killed_inside_its_fetch_the_others_go_on(tmp_path, monkeypatch):
    hold(monkeypatch, source=2)
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, NO_COLLECTIVE_WAIT, "runtime.num_ranks=4",
                                      "runtime.rollout_ranks=2", "ers.enabled=false")
        job.until(lambda: fetching(run_dir, 0) and fetching(run_dir, 1),
                  "ranks 0 and 1 inside their fetch")
        kill_inside(job, state, run_dir, 0, 2, "one of two rollout ranks")
        went_on(job, run_dir, 0, "rollout")
        assert_no_boundary_failed(job, run_dir, [1, 2, 3])


def test_the_last_rollout_rank_killed_inside_its_fetch_a_trainer_rank_takes_its_place(
        tmp_path, monkeypatch):
    hold(monkeypatch, source=1)
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, NO_COLLECTIVE_WAIT, "runtime.system=async",
                                      "ers.enabled=false")
        job.until(lambda: fetching(run_dir, 0), "rank 0 inside its fetch")
        kill_inside(job, state, run_dir, 0, 1, "the last rollout rank")
        went_on(job, run_dir, 0, "rollout")
        (moved,) = [e for e in events(run_dir, "role_change") if e["dst"] == "rollout"]
        assert moved["reason"] == "no_rollout"
        assert_no_boundary_failed(job, run_dir, [1, 2])


def test_the_source_actor_killed_while_its_receivers_wait_another_actor_sends(
        tmp_path, monkeypatch):
    """Rank 1 is the source (the first actor that stays one): its receivers' fetches break off
    when it dies, and the boundary goes out again from rank 2, the actor left."""
    hold(monkeypatch, source=1)
    with chaos(tmp_path) as jobs:
        job, state, run_dir = started(jobs, tmp_path, NO_COLLECTIVE_WAIT, "ers.enabled=false")
        job.until(lambda: fetching(run_dir, 0) and holding(run_dir, 1),
                  "rank 1 holding the boundary, rank 0 inside its fetch")
        kill_inside(job, state, run_dir, 1, 1, "the source actor")
        went_on(job, run_dir, 1, "actor")
        assert "broke off" in rank_log(run_dir, 0)  # its first fetch, from the dead source
