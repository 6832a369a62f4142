"""Launching over SSH against launching here, side by side in one run, and what job control costs.

Part 1: the same small job (3 ranks, 6 steps, one seed) alternately run by the local launcher and
by the SSH launcher on two nodes that are two OpenSSH servers on loopback (node a: environment
service, coordinator, ranks 0-1; node b: rank 2), two rounds each. Per run: time to every process
started, job wall time, mean step time, goodput, reward.

Part 2: on a running SSH job, the wall time of each job-control command as a user runs it (a new
``tiderl`` process each: interpreter start-up included): ``status``, ``logs --rank 2``,
``top --once``, ``rebalance`` (request to applied at the next boundary), ``profile readiness``,
``stop`` (to no process left); and the SSH primitives the launcher polls with (one session open,
one process-state read).

Needs ``/usr/sbin/sshd`` (openssh-server) and to run as root (sshd's privilege separation
folder). Run: ``.venv/bin/python bench/launch.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' sshd helper
from machine import machine_info, write_result

from tests.integration.running_job import SMALL_JOB
from tests.integration.serving import tiderl_command
from tests.integration.sshd import client_key, sshd
from tiderl.launch.hosts import load_hosts
from tiderl.launch.job import run_local
from tiderl.launch.remote import run_ssh
from tiderl.launch.ssh import NodeSession
from tiderl.profile import load_profile
from tiderl.runtime.lineage import read_lineage

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6
ROUNDS = 2


def _hosts(folder: Path, a, b) -> Path:
    path = folder / "hosts.yaml"
    path.write_text(json.dumps({
        "defaults": {"user": a.user, "key_file": str(a.key_file), "python": sys.executable},
        "nodes": [{"name": "a", "host": a.host, "port": a.port, "devices": 2,
                   "workdir": str(folder / "a")},
                  {"name": "b", "host": b.host, "port": b.port, "devices": 1,
                   "workdir": str(folder / "b")}]}))
    return path


def _one_job(kind: str, hosts_path: Path, run_root: Path) -> dict:
    profile = load_profile("local", [*SMALL_JOB, f"job.steps={STEPS}"])
    started: dict[str, float] = {}
    t0 = time.monotonic()

    def on_start(_state) -> None:
        started["t"] = time.monotonic()

    if kind == "local":
        result = run_local(profile, run_root=run_root, on_start=on_start)
    else:
        result = run_ssh(profile, load_hosts(hosts_path), run_root=run_root, on_start=on_start)
    wall = time.monotonic() - t0
    metrics = read_lineage(result.run_dir).metrics
    assert result.exit_code == 0 and len(metrics) == STEPS, (kind, result)
    return {"launcher": kind, "started_s": round(started["t"] - t0, 2),
            "wall_s": round(wall, 2),
            "step_s_mean": round(statistics.mean(m.step_s for m in metrics), 3),
            "goodput_tok_s": metrics[-1]["goodput_tok_s"],
            "reward_mean": round(statistics.mean(m.reward_mean for m in metrics), 4),
            "trained_samples": sum(m.trained_samples for m in metrics)}


def _timed(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    proc = subprocess.run([*tiderl_command(), *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (args, proc.stderr)
    return round(time.monotonic() - t0, 2), proc


def _control(hosts_path: Path, run_root: Path, folder: Path) -> dict:
    argv = [*tiderl_command(), "launch", "--nodes", str(hosts_path), "--run-root",
            str(run_root), "--set", "job.steps=1000"]
    for item in SMALL_JOB:
        argv += ["--set", item]
    log = (folder / "launcher.log").open("w")
    launcher = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        job = _wait_step(run_root, folder / "a", 2)
        root = ("--run-root", str(run_root))
        out = {"status_s": _timed("status", job, *root)[0],
               "logs_rank_s": _timed("logs", job, "--rank", "2", *root)[0],
               "top_once_s": _timed("top", job, *root, "--once", "--json")[0],
               "rebalance_applied_s": _timed("rebalance", job, "--rollout", "2", "--trainer",
                                             "1", *root)[0],
               "profile_readiness_s": _timed("measure", "readiness", "--job", job, *root)[0]}
        out["stop_s"] = _timed("stop", job, *root)[0]
        launcher.wait(60)
        return out
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()


def _wait_step(run_root: Path, workdir: Path, steps: int) -> str:
    """The job in ``run_root`` once its coordinator (node a) has written ``steps`` steps."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for job in run_root.glob("*/job.json"):
            path = workdir / "runs" / job.parent.name / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) >= steps:
                return job.parent.name
        time.sleep(0.5)
    raise RuntimeError("the SSH job made no progress")


def _primitives(hosts_path: Path) -> dict:
    node = load_hosts(hosts_path).nodes[1]
    opens, polls = [], []
    for _ in range(5):
        t0 = time.monotonic()
        session = NodeSession(node).open()
        opens.append(time.monotonic() - t0)
        t0 = time.monotonic()
        session.states([1])
        polls.append(time.monotonic() - t0)
        session.close()
    return {"ssh_open_s_median": round(statistics.median(opens), 3),
            "state_read_s_median": round(statistics.median(polls), 3)}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tiderl-bench-launch-") as tmp:
        folder = Path(tmp)
        key = client_key(folder)
        with sshd(folder / "sshd-a", key) as a, sshd(folder / "sshd-b", key) as b:
            hosts_path = _hosts(folder, a, b)
            runs = [_one_job(kind, hosts_path, folder / "runs")
                    for _ in range(ROUNDS) for kind in ("local", "ssh")]
            control = _control(hosts_path, folder / "runs-control", folder)
            primitives = _primitives(hosts_path)

    def mean(kind: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs if r["launcher"] == kind)

    ratios = {key: round(mean("ssh", key) / mean("local", key), 3)
              for key in ("started_s", "wall_s", "step_s_mean", "goodput_tok_s")}
    result = {"benchmark": "launch", "machine": machine_info(), "steps": STEPS,
              "profile_overrides": SMALL_JOB, "runs": runs, "ssh_over_local": ratios,
              "job_control_s": control, "ssh_primitives": primitives}
    write_result(ROOT / "bench" / "results" / "launch.json", result)
    print(json.dumps({"ssh_over_local": ratios, "job_control_s": control,
                      "ssh_primitives": primitives}, indent=2))


if __name__ == "__main__":
    main()
