"""new_run_dir: the run folder of a new job is made atomically, so launches into one run root in
the same second (or millisecond) each get their own id and folder, ids in launch order; a run
root that cannot hold a folder is one LaunchRefused line."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from tiderl.launch.local import LaunchRefused
from tiderl.launch.run_folders import job_id_at, kept_if_used, new_run_dir

NOW = 1796548765.25  # one start time shared by every racing launch below


def _claim_all(root, count: int, now: float | None) -> list:
    """``count`` threads released together, each making a run folder in ``root``."""
    start = threading.Barrier(count)
    folders: list = []

    def claim() -> None:
        start.wait()
        folders.append(new_run_dir(root, "sync", now=now))

    threads = [threading.Thread(target=claim) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return folders


def test_launches_in_one_millisecond_get_distinct_folders_one_millisecond_apart(tmp_path):
    folders = _claim_all(tmp_path, 8, NOW)
    assert len({f.name for f in folders}) == 8 and all(f.is_dir() for f in folders)
    first_ms = round(NOW * 1000)
    assert sorted(f.name for f in folders) == [job_id_at(first_ms + i, "sync") for i in range(8)]


def test_launches_racing_on_the_clock_get_distinct_folders(tmp_path):
    folders = _claim_all(tmp_path, 8, None)
    assert len({f.name for f in folders}) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in folders)


def _claim_in_process(root: str, now: float, names) -> None:
    names.put(new_run_dir(Path(root), "async", now=now).name)


def test_launcher_processes_in_one_millisecond_get_distinct_folders(tmp_path):
    context = multiprocessing.get_context("spawn")
    names = context.Queue()
    procs = [context.Process(target=_claim_in_process, args=(str(tmp_path), NOW, names))
             for _ in range(3)]
    for proc in procs:
        proc.start()
    got = sorted(names.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    first_ms = round(NOW * 1000)
    assert got == [job_id_at(first_ms + i, "async") for i in range(3)]


def test_a_later_launch_sorts_after_an_earlier_one_of_another_system(tmp_path):
    earlier = new_run_dir(tmp_path, "sync", now=NOW)
    later = new_run_dir(tmp_path, "async", now=NOW + 0.001)
    assert earlier.name < later.name
    assert earlier.name.startswith(time.strftime("%Y%m%d-%H%M%S", time.localtime(NOW)))
    assert earlier.name.endswith("-250-sync")


def test_a_given_job_id_is_used_once(tmp_path):
    assert new_run_dir(tmp_path, "sync", job_id="bench-a").name == "bench-a"
    with pytest.raises(LaunchRefused, match=r"run folder .*bench-a exists"):
        new_run_dir(tmp_path, "sync", job_id="bench-a")


def test_a_run_root_that_is_a_file_is_one_line(tmp_path):
    root = tmp_path / "runs"
    root.write_text("not a folder")
    with pytest.raises(LaunchRefused) as caught:
        new_run_dir(root / "sub", "sync")
    assert str(caught.value) == f"cannot make a run folder in {root / 'sub'}: Not a directory"


def test_a_refused_launch_leaves_no_empty_folder(tmp_path):
    folder = new_run_dir(tmp_path, "sync")
    with pytest.raises(LaunchRefused), kept_if_used(folder):
        raise LaunchRefused("no ports")
    assert not folder.exists()
    used = new_run_dir(tmp_path, "sync")
    with pytest.raises(LaunchRefused), kept_if_used(used):
        (used / "job.json").write_text("{}")
        raise LaunchRefused("a process failed")
    assert (used / "job.json").exists()
