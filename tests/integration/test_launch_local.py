"""The local executor with real processes: job.json, logs, stopping without orphans (by PID)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.waiting import wait_until
from tiderl.launch.local import (
    JobRecord,
    LaunchError,
    LocalExecutor,
    ProcessCommand,
    group_members,
    is_running,
    process_state,
)

SLEEPER = "import time; print('up', flush=True); time.sleep(60)"
# ignores SIGTERM, and starts a grandchild in its group that ignores it too
STUBBORN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
            "print('up', flush=True); time.sleep(60)")


def _job(tmp_path) -> LocalExecutor:
    return LocalExecutor(JobRecord(job_id="j1", run_dir=str(tmp_path), created=time.time()))


def _wait_for_logs(executor: LocalExecutor, text: str = "up") -> None:
    """Until every process has printed ``text``; fails at once if one has exited."""
    def exited() -> str | None:
        ended = executor.exited()
        return f"exited: {[(r.name, code) for r, code in ended]}" if ended else None
    wait_until(lambda: all(text in Path(r.log).read_text() for r in executor.job.processes),
               f"{text!r} from every process", gone=exited)


def _wait_gone(pids: list[int]) -> None:
    """Until none of ``pids`` runs: a SIGKILL takes effect once the process is scheduled again
    (these would otherwise sleep on for a minute)."""
    wait_until(lambda: not any(is_running(pid) for pid in pids),
               lambda: f"every one gone: {[(pid, process_state(pid)) for pid in pids]}",
               timeout_s=30)


def test_start_records_pids_and_logs_then_stop_leaves_nothing(tmp_path):
    executor = _job(tmp_path)
    executor.start([ProcessCommand("env", "env", (sys.executable, "-c", SLEEPER)),
                    ProcessCommand("rank0", "rank", (sys.executable, "-c", STUBBORN), rank=0),
                    ProcessCommand("rank1", "rank", (sys.executable, "-c", SLEEPER), rank=1,
                                   env={"TIDERL_TEST": "1"})])
    records = executor.job.processes
    _wait_for_logs(executor)
    saved = json.loads((tmp_path / "job.json").read_text())
    assert [p["name"] for p in saved["processes"]] == ["env", "rank0", "rank1"]
    assert [p["pid"] for p in saved["processes"]] == [r.pid for r in records]
    assert JobRecord.load(tmp_path).processes == records
    stubborn_group = group_members(records[1].pid)
    assert len(stubborn_group) == 2  # rank0 and its grandchild
    assert all(is_running(r.pid) for r in records)

    outcome = executor.stop(grace_s=1.0)
    assert outcome == {"env": "terminated", "rank0": "killed", "rank1": "terminated"}
    _wait_gone([r.pid for r in records] + stubborn_group)
    assert executor.stop(grace_s=0.1) == dict.fromkeys(["env", "rank0", "rank1"], "gone")


def test_a_process_that_cannot_start_stops_the_others(tmp_path):
    executor = _job(tmp_path)
    with pytest.raises(LaunchError, match="rank1: could not start '/no/such/python'"):
        executor.start([ProcessCommand("rank0", "rank", (sys.executable, "-c", SLEEPER)),
                        ProcessCommand("rank1", "rank", ("/no/such/python", "-c", "pass"))])
    (started,) = executor.job.processes
    assert not is_running(started.pid)


def test_exited_reports_exit_codes(tmp_path):
    executor = _job(tmp_path)
    executor.start([ProcessCommand("quick", "rank", (sys.executable, "-c", "raise SystemExit(3)")),
                    ProcessCommand("slow", "rank", (sys.executable, "-c", SLEEPER))])
    # until the quick one has ended (the slow one sleeps for a minute)
    wait_until(executor.exited, "an exit", timeout_s=50)
    assert [(r.name, code) for r, code in executor.exited()] == [("quick", 3)]
    executor.stop(grace_s=1.0)


def test_loading_a_missing_job_is_one_line(tmp_path):
    with pytest.raises(LaunchError, match="no such job"):
        JobRecord.load(tmp_path / "nope")


def test_a_jobs_ports_are_distinct_free_and_outside_the_ephemeral_range():
    """An outgoing connection (the launcher's own health polls) takes its local port from the
    ephemeral range; a port picked there could be gone before its daemon binds it."""
    import socket
    from pathlib import Path

    from tiderl.ports import listen_ports

    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
                 .split())
    ports = listen_ports(12)
    assert len(set(ports)) == 12 and not any(low <= p <= high for p in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free to listen on


def test_a_remote_nodes_ports_come_from_nodectl_as_one_json_line(capsys):
    """What the launcher runs over SSH on a node to pick its daemons' ports; more than the
    node has is a one-line error, exit 2."""
    import json

    from tiderl.launch.nodectl import main
    from tiderl.ports import ephemeral_range

    low, high = ephemeral_range()
    assert main(["ports", "5", "--host", "127.0.0.1"]) == 0
    ports = json.loads(capsys.readouterr().out)
    assert len(set(ports)) == 5 and not any(low <= p <= high for p in ports)
    assert main(["ports", "70000", "--host", "127.0.0.1"]) == 2
    assert json.loads(capsys.readouterr().out)["error"].startswith("no 70000 free ports")
    assert main(["ports", "1", "--host", "no-such-host.invalid"]) == 2
    assert "does not resolve" in json.loads(capsys.readouterr().out)["error"]


def test_ports_are_picked_by_host_name_too_and_none_asked_is_none():
    from tiderl.ports import free_port, listen_ports

    assert listen_ports(0) == []
    assert free_port("localhost") >= 1024
