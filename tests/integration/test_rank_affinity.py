"""runtime.cpu_affinity: the core sets (exact), the launch plan's slots, and a real started rank
daemon pinned to its slot's cores (read back from /proc)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tiderl.launch.job import local_endpoints, prepare_run_dir
from tiderl.launch.local import JobRecord, LocalExecutor
from tiderl.launch.plan import plan_local, port_names
from tiderl.launch.run_folders import new_run_dir
from tiderl.profile import ProfileError, load_profile
from tiderl.runtime.affinity import core_set, parse_slot
from tiderl.trainer.spawn import free_port

SPREAD = ["runtime.cpu_affinity=spread", "runtime.num_ranks=3", "runtime.rollout_ranks=1"]


def test_core_sets_are_contiguous_blocks_or_shared_cores_round_robin():
    assert [core_set(range(8), i, 3) for i in range(3)] == [(0, 1), (2, 3, 4), (5, 6, 7)]
    assert [core_set([3, 1], i, 4) for i in range(4)] == [(1,), (3,), (1,), (3,)]
    assert core_set([5], 0, 1) == (5,)
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        core_set(range(4), 2, 2)
    assert parse_slot("1/4") == (1, 4)
    with pytest.raises(ValueError, match="I/N"):
        parse_slot("two")


def test_the_plan_gives_each_rank_a_slot_only_under_spread():
    spread = plan_local(load_profile("local", SPREAD)).ranks
    assert [p.cpu_slot for p in spread] == [(0, 3), (1, 3), (2, 3)]
    assert [p.cpu_slot for p in plan_local(load_profile("local", SPREAD[1:])).ranks] == \
        [None] * 3
    with pytest.raises(ProfileError, match="cpu_affinity"):
        load_profile("local", ["runtime.cpu_affinity=tight"])


def _allowed(pid: int) -> list[set[int]]:
    """The allowed CPUs of every thread of ``pid``, from /proc/<pid>/task/*/status."""
    sets = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                sets.append(_cpu_list(line.split(":", 1)[1].strip()))
    return sets


def _cpu_list(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def test_a_started_rank_daemon_is_pinned_to_its_slot(tmp_path):
    profile = load_profile("local", SPREAD)
    run_dir = new_run_dir(tmp_path, profile.runtime.system)
    ep = local_endpoints(profile, {name: free_port() for name in port_names(profile)})
    plan = plan_local(profile, sys.executable, str(run_dir), ep)
    prepare_run_dir(profile, plan, run_dir)
    rank1 = [p for p in plan.processes if p.name == "rank1"]
    assert "--cpu-slot" in rank1[0].argv
    executor = LocalExecutor(JobRecord("affinity", str(run_dir), time.time()))
    executor.start(rank1)  # it pins itself, then waits for a world that never forms
    (record,) = executor.job.processes
    try:
        deadline = time.monotonic() + 60
        log = Path(record.log)
        while "pinned to cores" not in log.read_text():
            assert not executor.exited(), log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        expected = set(core_set(os.sched_getaffinity(0), 1, 3))
        assert os.sched_getaffinity(record.pid) == expected
        assert all(cores == expected for cores in _allowed(record.pid))
    finally:
        executor.stop(grace_s=1.0)
