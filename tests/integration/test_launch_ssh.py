"""`tiderl launch --nodes hosts.yaml` against real OpenSSH servers on loopback: two sshd on two
ports are two nodes (node a: env, coordinator, ranks 0 and 1; node b: rank 2), each with its own
workdir. The launcher logs in with a generated key; every daemon starts detached over SSH."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.integration.running_job import SMALL_JOB
from tests.integration.serving import free_port, tiderl_command
from tests.integration.sshd import SSHNode, client_key, sshd
from tests.integration.test_cli import assert_one_line_error, tiderl
from tiderl.launch.local import JobRecord, group_members, is_running
from tiderl.runtime.bus.keys import SERVER_SECRET
from tiderl.runtime.report import IMAGES

TIMEOUT_S = 300


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ssh")
    key = client_key(folder)
    with sshd(folder / "sshd-a", key) as a, sshd(folder / "sshd-b", key) as b:
        yield folder, a, b


def _hosts_yaml(path: Path, a: SSHNode, b: SSHNode, **node_b) -> Path:
    b_fields = {"name": "b", "host": b.host, "port": b.port, "devices": 1,
                "workdir": str(path.parent / "b"), **node_b}
    path.write_text(json.dumps({  # JSON is YAML
        "defaults": {"user": a.user, "key_file": str(a.key_file), "python": sys.executable},
        "nodes": [{"name": "a", "host": a.host, "port": a.port, "devices": 2,
                   "workdir": str(path.parent / "a")}, b_fields],
    }))
    return path


def _launch_argv(hosts: Path, run_root: Path, steps: int) -> list[str]:
    argv = ["launch", "--nodes", str(hosts), "--run-root", str(run_root),
            "--set", f"job.steps={steps}"]
    for item in SMALL_JOB:
        argv += ["--set", item]
    return argv


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _files(folder: Path) -> set[str]:
    """Its regular files (symbolic links, like wandb's debug.log, are not fetched)."""
    return {str(f.relative_to(folder)) for f in folder.rglob("*")
            if f.is_file() and not f.is_symlink()}


def _assert_nothing_left(state: JobRecord) -> None:
    for record in state.processes:  # both nodes are this machine: check by PID and group
        assert not is_running(record.pid), f"{record.name} (pid {record.pid}) still runs"
        assert group_members(record.pid) == [], f"{record.name} left children behind"


def test_a_two_node_job_over_ssh_trains_like_a_local_one(nodes, tmp_path):
    _, a, b = nodes
    hosts = _hosts_yaml(tmp_path / "hosts.yaml", a, b)
    logging = ["--set", "logging.backends=[jsonl,tensorboard,wandb]",
               "--set", "logging.rollouts=true", "--set", "report.plots=true"]
    proc = subprocess.run([*tiderl_command(), *_launch_argv(hosts, tmp_path / "runs", 3),
                           *logging], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    state = JobRecord.load(run_dir)
    # job.json: every process with its node, PID and log; the nodes to reach them again
    assert {(p.name, p.host) for p in state.processes} == {
        ("env", "a"), ("coordinator", "a"), ("rank0", "a"), ("rank1", "a"), ("rank2", "b")}
    assert set(state.info["nodes"]) == {"a", "b"}
    assert all(p.log.startswith(str(tmp_path / p.host / "runs")) for p in state.processes)
    # the keys went out 0600 in a 0700 folder; the server secret to the coordinator's node only
    keys_a = tmp_path / "a" / "runs" / state.job_id / "keys"
    keys_b = tmp_path / "b" / "runs" / state.job_id / "keys"
    assert (keys_a / SERVER_SECRET).exists() and not (keys_b / SERVER_SECRET).exists()
    assert {f.stat().st_mode & 0o777 for f in [*keys_a.iterdir(), *keys_b.iterdir()]} == {0o600}
    assert keys_b.stat().st_mode & 0o777 == 0o700
    # it trained as the local job does (tests/e2e/test_runtime_job.py): the results came back
    metrics = _read(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(m["staleness_max"] <= 2 for m in metrics)  # max_staleness 1, carry 1
    assert all(4 <= m["trained_samples"] <= 8 and m["trained_samples"] % 4 == 0
               for m in metrics)
    assert all(m["loss"] is not None and m["goodput_tok_s"] > 0 for m in metrics)
    stop = _read(run_dir / "events.jsonl")[-1]
    assert stop["kind"] == "stop" and stop["reason"] == "done"
    accounting = stop["groups"]
    assert accounting["fed"] == sum(accounting[k] for k in ("trained", "dropped", "buffered",
                                                              "rolling_out"))
    assert (run_dir / "report.md").exists()
    assert all((run_dir / name).stat().st_size > 0 for name in IMAGES)  # the figures too
    assert "rank2" in (run_dir / "logs" / "rank2.log").read_text()  # fetched from node b
    # the coordinator's TensorBoard and wandb folders (nested) and each node's recorded episodes
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert _files(run_dir / "wandb") == _files(tmp_path / "a" / "runs" / state.job_id / "wandb")
    recorded = {f.name for node in "ab"
                for f in (tmp_path / node / "runs" / state.job_id / "rollouts").glob("*.jsonl")}
    assert "rank-0.jsonl" in recorded
    assert {f.name for f in (run_dir / "rollouts").iterdir()} == recorded
    _assert_nothing_left(state)
    status = tiderl("status", state.job_id, "--run-root", str(tmp_path / "runs"), "--json")
    payload = json.loads(status.stdout)
    assert payload["state"] == "done" and payload["steps"] == "3/3"
    assert {p["state"] for p in payload["processes"]} <= {"gone", "zombie (ended)"}


def test_status_logs_and_stop_act_on_a_running_ssh_job(nodes, tmp_path):
    _, a, b = nodes
    hosts = _hosts_yaml(tmp_path / "hosts.yaml", a, b)
    run_root = tmp_path / "runs"
    log = (tmp_path / "launcher.log").open("w")
    launcher = subprocess.Popen([*tiderl_command(), *_launch_argv(hosts, run_root, 500)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        job = _wait_for_step(run_root, tmp_path / "a", launcher, step=1)
        root = ("--run-root", str(run_root))
        state = JobRecord.load(run_root / job)
        with ThreadPoolExecutor(1) as side:  # the rebalance waits for a boundary: the reads
            rebalancing = side.submit(_rebalance_works_on_it, job, root)  # run meanwhile
            _reads_work_on_it(job, root, state)
            rebalancing.result()
        stop = tiderl("stop", job, *root, "--json")
        assert stop.returncode == 0, stop.stderr
        assert json.loads(stop.stdout)["launcher_stopped"] is True
        assert launcher.wait(30) == 143  # SIGTERM: it stopped the job and said so
        _assert_nothing_left(state)
        assert (run_root / job / "metrics.jsonl").exists()  # fetched when it stopped
        ended = tiderl("top", job, *root, "--once", "--timeout", "5")
        assert "ended" in assert_one_line_error(ended, 1)  # read on its nodes over SSH
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.close()


def _reads_work_on_it(job: str, root: tuple[str, ...], state: JobRecord) -> None:
    """The commands that only read the job, each a new `tiderl` process as a user runs it, all
    at once (over SSH on both nodes, and from the coordinator), and its /metrics."""
    commands = {
        "status": ("status", job, *root, "--json"),
        "logs of rank 2": ("logs", job, "--rank", "2", *root),
        "every log": ("logs", job, *root),
        "logs of rank 7": ("logs", job, "--rank", "7", *root),
        "top": ("top", job, *root, "--once", "--json"),
        "readiness": ("measure", "readiness", "--job", job, *root, "--json"),
        "kv": ("measure", "kv", "--job", job, *root, "--duration", "1", "--interval", "0.5",
               "--json"),
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        running = {name: pool.submit(tiderl, *args) for name, args in commands.items()}
        text = httpx.get(state.info["metrics"], timeout=10).text  # the coordinator's /metrics
        done = {name: future.result() for name, future in running.items()}
    assert "tiderl_goodput_tokens_total" in text and 'tiderl_ranks{role="rollout"}' in text
    status = done["status"]
    assert status.returncode == 0, status.stderr
    payload = json.loads(status.stdout)
    assert payload["state"] == "running" and payload["where"] == "a, b"
    assert {p["node"] for p in payload["processes"] if p["name"] == "rank2"} == {"b"}
    assert all(p["state"].startswith("running") for p in payload["processes"])
    logs = done["logs of rank 2"]
    assert logs.returncode == 0 and " rank2 " in logs.stdout  # read from node b over SSH
    every = done["every log"]
    assert "coordinator | " in every.stdout and "      rank2 | " in every.stdout
    assert_one_line_error(done["logs of rank 7"], 1)
    top = done["top"]
    assert top.returncode == 0, top.stderr
    snapshot = json.loads(top.stdout)["snapshot"]
    assert len(snapshot["roles"]) == 3 and snapshot["metrics"]["steps"] == 500
    readiness = done["readiness"]
    assert readiness.returncode == 0, readiness.stderr
    steps = json.loads(readiness.stdout)["steps"]  # metrics.jsonl, fetched from node a
    assert len(steps) >= 1 and Path(json.loads(readiness.stdout)["png"]).exists()
    kv = done["kv"]
    assert kv.returncode == 0, kv.stderr
    assert json.loads(kv.stdout)["samples"]


def _rebalance_works_on_it(job: str, root: tuple[str, ...]) -> None:
    rebalance = tiderl("rebalance", job, "--rollout", "2", "--trainer", "1", *root, "--json")
    assert rebalance.returncode == 0, rebalance.stderr
    applied = json.loads(rebalance.stdout)
    assert applied["status"] == "applied" and sorted(applied["roles"]) == [
        "actor", "rollout", "rollout"]
    refused = tiderl("rebalance", job, "--rollout", "3", "--trainer", "1", *root)
    assert "3 live ranks" in assert_one_line_error(refused, 1)


def _wait_for_step(run_root: Path, workdir_a: Path, launcher: subprocess.Popen,
                   step: int) -> str:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the launcher ended early"
        for metrics in workdir_a.glob("runs/*/metrics.jsonl"):
            if len(metrics.read_text().splitlines()) >= step:
                return metrics.parent.name
        time.sleep(0.5)
    raise AssertionError(f"no step {step} within {TIMEOUT_S} s")


@pytest.mark.parametrize("case", ["unreachable", "wrong key", "no python", "no tiderl"])
def test_a_bad_node_fails_in_one_line_naming_it_and_starts_nothing(nodes, tmp_path, case):
    _, a, b = nodes
    node_b = {
        "unreachable": {"port": free_port()},  # nothing listens there
        "wrong key": {"key_file": str(client_key(tmp_path / "other"))},
        "no python": {"python": str(tmp_path / "no" / "python")},
        "no tiderl": {"python": "/usr/bin/python3"},
    }[case]
    hosts = _hosts_yaml(tmp_path / "hosts.yaml", a, b, **node_b)
    logging = ["--set", "logging.backends=[jsonl,tensorboard,wandb]",
               "--set", "logging.rollouts=true"]
    proc = subprocess.run([*tiderl_command(), *_launch_argv(hosts, tmp_path / "runs", 3),
                           *logging], capture_output=True, text=True, timeout=TIMEOUT_S)
    line = assert_one_line_error(proc, 1)
    assert line.startswith(f"error: tiderl launch: node b ({a.user}@127.0.0.1:"), line
    expected = {"unreachable": "unreachable", "wrong key": "SSH login refused with key",
                "no python": "no/python: not found", "no tiderl": "tiderl is not installed"}
    assert expected[case] in line
    assert not (tmp_path / "runs").exists()  # checked before anything was made or started
    assert not list((tmp_path / "a").glob("runs/*"))

