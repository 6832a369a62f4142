"""`tiderl rebalance` against a real job: the plan goes over the CurveZMQ bus, is applied at the
next boundary and held; impossible plans are refused in one line and the job goes on."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration.bus_ranks import ARRIVE_S, sent_so_far
from tests.integration.running_job import running_job
from tests.integration.serving import tiderl_command
from tiderl.cli.main import main as tiderl_main


def tiderl(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([*tiderl_command(), *args], capture_output=True, text=True,
                          timeout=timeout)


def tiderl_here(*args: str) -> subprocess.CompletedProcess:
    """``tiderl *args`` run by the CLI's ``main`` in this process (imported with this module,
    before any job starts), its stdout and stderr caught: the same command without a new
    interpreter, whose start takes seconds on a loaded machine while a job's steps go on."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tiderl_main(list(args))
    return subprocess.CompletedProcess(["tiderl", *args], code, out.getvalue(), err.getvalue())


def one_line_error(proc: subprocess.CompletedProcess, code: int = 1) -> str:
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def read(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen,
                  timeout_s: float = 120.0) -> list[dict]:
    """metrics.jsonl once it has step ``step``'s record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read(run_dir, "metrics.jsonl")
        if records and records[-1]["step"] >= step:
            return records
        assert proc.poll() is None, "the job ended"
        assert time.monotonic() < deadline, f"step {step} did not finish in {timeout_s:.0f} s"
        time.sleep(0.2)


def kinds(run_dir: Path, *wanted: str) -> list[dict]:
    return [e for e in read(run_dir, "events.jsonl") if e["kind"] in wanted]


def rebalance_applied(job: str, rollout: str, trainer: str, args: tuple[str, ...],
                      run: Callable[..., subprocess.CompletedProcess] = tiderl) -> dict:
    """Run ``tiderl rebalance`` (by ``run``: a process of its own, or :func:`tiderl_here`) until
    applied; its rebalance_applied event."""
    proc = run("rebalance", job, "--rollout", rollout, "--trainer", trainer, *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("accepted: applies at the next boundary (after step ")
    assert "applied at version" in proc.stdout and "held until" in proc.stdout
    run_dir = Path(args[-1]) / job
    return kinds(run_dir, "rebalance_applied")[-1]


def test_a_manual_plan_in_mode_tiderl_is_applied_held_and_handed_back(tmp_path):
    """ERS moves ranks every step here (cold start, then its signals); the manual plan replaces
    its plan at the next boundary and holds until --auto. Refusals leave the job running."""
    with running_job(tmp_path / "runs", wait_steps=1) as (state, launcher):
        run_dir = Path(state.run_dir)
        args = ("--run-root", str(tmp_path / "runs"))
        # impossible plans: one line with the reason, exit 1, an event, nothing pending
        line = one_line_error(tiderl("rebalance", state.job_id, "--rollout", "3", "--trainer",
                                     "1", *args))
        assert line == ("error: tiderl rebalance: refused: --rollout 3 + --trainer 1 = 4, "
                        "but the job has 3 live ranks")
        line = one_line_error(tiderl("rebalance", state.job_id, "--rollout", "2", "--trainer",
                                     "1", "--mode", "decoupled", *args))
        assert line.endswith("refused: decoupled needs at least 2 trainer ranks (a Ref and an "
                             "Actor), got --trainer 1")
        refused = kinds(run_dir, "rebalance_refused")
        assert [e["request"] for e in refused] == ["R3/T1", "R2/T1 decoupled"]
        assert launcher.poll() is None

        # two plans: the second starts from the first's held layout, so it must move a rank
        first = rebalance_applied(state.job_id, "1", "2", args)
        assert sorted(first["roles"])[-1] == "rollout" and first["roles"].count("rollout") == 1
        second = rebalance_applied(state.job_id, "2", "1", args)
        assert second["version"] > first["version"]
        version = second["version"]
        assert sorted(second["roles"]) == ["actor", "rollout", "rollout"]
        assert second["placement"] == "colocated" and second["step"] == version
        events = read(run_dir, "events.jsonl")
        requested = [e for e in events if e["kind"] == "rebalance_requested"]
        assert [e["request"] for e in requested] == ["R1/T2", "R2/T1"]
        assert events.index(requested[1]) < events.index(second)
        moves = [e for e in events if e["kind"] == "role_change"
                 and e["version"] >= first["version"]]
        assert {e["version"] for e in moves} <= {first["version"], version}  # held in between
        assert [e for e in moves if e["version"] == version]
        assert all(e["reason"] == "manual" for e in moves)
        # the steps after the boundary run the manual layout, and ERS leaves it: held
        records = wait_for_step(run_dir, version + 1, launcher)
        held = [r for r in records if r["step"] in (version, version + 1)]
        assert len(held) == 2
        for record in held:
            assert sorted(record["roles"]) == ["actor", "rollout", "rollout"], record
            assert record["num_trainer"] == 1 and record["num_rollout"] == 2
            assert record["ers_reason"] == "manual"
        assert not [e for e in kinds(run_dir, "role_change") if e["version"] > version]

        proc = tiderl("rebalance", state.job_id, "--auto", "--json", *args)
        assert proc.returncode == 0, proc.stderr
        answer = json.loads(proc.stdout)
        assert answer["status"] == "applied" and "ERS plans again" in answer["reason"]
        (auto,) = kinds(run_dir, "rebalance_auto")
        assert auto["was_held"] is True
        assert launcher.poll() is None
    # the job is gone: nobody answers, in one line
    line = one_line_error(tiderl("rebalance", state.job_id, "--rollout", "2", "--trainer", "1",
                                 "--timeout", "0.1", *args))
    assert "no answer from the coordinator of job" in line


def test_a_fixed_split_job_takes_a_manual_layout_and_refuses_a_placement(tmp_path):
    """System async without ERS: the split stays fixed until an operator moves it."""
    with running_job(tmp_path / "runs", "runtime.system=async", "ers.enabled=false",
                     wait_steps=1) as (state, launcher):
        run_dir = Path(state.run_dir)
        args = ("--run-root", str(tmp_path / "runs"))
        line = one_line_error(tiderl("rebalance", state.job_id, "--rollout", "1", "--trainer",
                                     "2", "--placement", "colocated", *args))
        assert line.endswith("refused: system async has no RA2P placement (only system tiderl "
                             "runs decoupled or colocated): leave out --placement")
        proc = tiderl("rebalance", state.job_id, "--rollout", "2", "--trainer", "1", "--no-wait",
                      "--json", *args)
        assert proc.returncode == 0, proc.stderr
        answer = json.loads(proc.stdout)
        assert answer["status"] == "accepted"
        assert answer["roles"] == ["rollout", "actor", "rollout"]  # the highest actor moves
        deadline = time.monotonic() + 120
        while not kinds(run_dir, "rebalance_applied"):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        (applied,) = kinds(run_dir, "rebalance_applied")
        records = wait_for_step(run_dir, applied["version"] + 1, launcher)
        before = [r for r in records if r["step"] < applied["version"]]
        after = [r for r in records if r["step"] >= applied["version"]]
        assert all(r["roles"] == ["rollout", "actor", "actor"] for r in before)
        assert len(after) >= 2
        assert all(r["roles"] == ["rollout", "actor", "rollout"] and r["num_trainer"] == 1
                   for r in after)
        assert launcher.poll() is None


def test_the_coordinator_answers_requests_on_a_real_bus_without_ranks(tmp_path):
    """The request half in process (a real Coordinator on a loopback bus, no rank processes):
    sync jobs and the last step refuse, a newer plan replaces a pending one, --auto drops it."""
    from tiderl.core.types import Role
    from tiderl.profile import load_profile
    from tiderl.runtime.bus import BusClient, BusServer, Rebalance, RebalanceReply
    from tiderl.runtime.coordinator import Coordinator
    from tiderl.runtime.run_log import RunLog

    def ask(coordinator, server, client, msg) -> list[RebalanceReply]:
        """The coordinator's answers to ``msg``: all it sent the asker once it handled it."""
        client.send(msg)
        got = server.recv(ARRIVE_S)
        assert got is not None
        coordinator.handle(*got)
        return sent_so_far(server, got[0], client)

    def coordinator_for(mode: str, steps: int, folder: Path):
        folder.mkdir()
        rollout = 3 if mode == "sync" else 1
        profile = load_profile("local", ["runtime.num_ranks=3", f"runtime.rollout_ranks={rollout}",
                                         f"runtime.system={mode}", f"job.steps={steps}"])
        roles = [Role.ROLLOUT] * 3 if mode == "sync" else [Role.ROLLOUT, Role.ACTOR, Role.ACTOR]
        return profile, roles

    with BusServer(None) as server, BusClient(server.endpoint, None, b"ctl-a") as a, \
            BusClient(server.endpoint, None, b"ctl-b") as b:
        profile, roles = coordinator_for("sync", 5, tmp_path / "sync")
        sync = Coordinator(profile, server, roles, RunLog(tmp_path / "sync", time.monotonic))
        (reply,) = ask(sync, server, a, Rebalance(seq=1, rollout=2, trainer=1))
        assert (reply.ref, reply.status) == (1, "refused")
        assert reply.reason == "system sync: every rank rolls out and trains"
        (reply,) = ask(sync, server, a, Rebalance(seq=2, auto=True))
        assert reply.status == "refused" and reply.reason.startswith("system sync")
        sync.log.close()

        profile, roles = coordinator_for("tiderl", 5, tmp_path / "tiderl")
        job = Coordinator(profile, server, roles, RunLog(tmp_path / "tiderl", time.monotonic))
        (reply,) = ask(job, server, a, Rebalance(seq=1, rollout=2, trainer=1))
        assert (reply.status, reply.step, reply.roles) == (
            "accepted", 0, ["rollout", "actor", "rollout"])
        assert job.desk.note == "manual plan R2/T1 colocated: pending (next boundary, after " \
                                "step 0)"
        (reply,) = ask(job, server, b,
                       Rebalance(seq=7, rollout=1, trainer=2, placement="decoupled"))
        assert (reply.ref, reply.status, reply.roles) == (7, "accepted",
                                                          ["rollout", "actor", "ref"])
        (old,) = sent_so_far(server, b"ctl-a", a)
        assert (old.ref, old.status) == (1, "refused")
        assert old.reason == "replaced by a newer manual plan (R1/T2 decoupled)"
        (reply,) = ask(job, server, a, Rebalance(seq=2, auto=True))
        assert reply.status == "applied" and "ERS plans again" in reply.reason
        (dropped,) = sent_so_far(server, b"ctl-b", b)
        assert (dropped.ref, dropped.status, dropped.reason) == (7, "refused",
                                                                 "withdrawn by --auto")
        assert job.controller.manual.pending is None and not job.controller.manual.is_held
        job.controller.state.step = 4  # the last step runs: no boundary is left for a plan
        (reply,) = ask(job, server, a, Rebalance(seq=3, rollout=2, trainer=1))
        assert reply.status == "refused" and reply.reason.startswith("the job is finishing")
        job.log.close()
        events = [json.loads(line) for line in
                  (tmp_path / "tiderl" / "events.jsonl").read_text().splitlines()]
        assert [e["kind"] for e in events] == [
            "rebalance_requested", "rebalance_refused", "rebalance_requested",
            "rebalance_auto", "rebalance_refused"]
