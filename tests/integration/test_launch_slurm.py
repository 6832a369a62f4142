"""``tiderl launch --slurm`` in a real Slurm allocation (two nodes on loopback,
:mod:`tests.integration.slurm_cluster`): the job trains across the allocation's nodes, each
node's processes in a job step, its model by hub id resolved on each node; ``tiderl stop`` ends
it with its report; what cannot run is one line, exit 2, before anything starts."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.running_job import SMALL_JOB
from tests.integration.serving import tiderl_command
from tests.integration.slurm_cluster import slurm_cluster
from tests.integration.test_cli import assert_one_line_error
from tests.integration.test_hub_models import COMMIT, REPO, lay_out_cache
from tiderl.launch.local import JOB_FILE, JobRecord
from tiderl.models.random_init import write_random_checkpoint

JOB_S = 600.0  # a launch followed to its end (seconds of a few steps; a loaded machine: more)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> dict[str, str]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def launch_argv(run_root: Path, steps: int, *extra: str) -> list[str]:
    argv = ["salloc", "--nodes=2", "--quiet", *tiderl_command(), "launch", "--slurm",
            "--run-root", str(run_root), "--set", f"job.steps={steps}", *extra]
    for item in SMALL_JOB:
        argv += ["--set", item]
    return argv


def test_a_job_trains_across_the_allocation_one_step_per_node(cluster, tmp_path):
    # its model by hub id, from a cache laid out on disk (test_hub_models): each node resolves
    # it in a job step of its own before the job starts
    write_random_checkpoint("tiny", tmp_path / "model", seed=3)
    snapshot = lay_out_cache(tmp_path / "hf", REPO, tmp_path / "model", COMMIT, "main")
    env = {**cluster, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    runs = tmp_path / "runs"
    proc = subprocess.run(launch_argv(runs, 2, "--json", "--set", f"model.path={REPO}"),
                          env=env, capture_output=True, text=True, timeout=JOB_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = Path(json.loads(proc.stdout)["run_dir"])
    job = JobRecord.load(run_dir)
    assert job.info["model"] == {"id": REPO, "revision": COMMIT, "folder": str(snapshot),
                                 "nodes": ["n1", "n2"]}
    hosts = {r.name: r.host for r in job.processes}
    assert hosts == {"env": "n1", "coordinator": "n1", "rank0": "n1", "rank1": "n1",
                     "rank2": "n2"}
    slurm = job.info["slurm"]
    assert slurm["nodes"] == ["n1", "n2"]
    steps = slurm["steps"]  # one job step per node, holding that node's processes
    assert sorted(steps.values()) == [["env", "coordinator", "rank0", "rank1"], ["rank2"]]
    assert all(step.startswith(f"{slurm['job_id']}.") for step in steps)
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 2
    assert (run_dir / "report.md").exists()
    status = subprocess.run([*tiderl_command(), "status", job.job_id, "--run-root",
                             str(runs), "--json"], env=cluster, capture_output=True,
                            text=True, timeout=60)
    assert json.loads(status.stdout)["state"] == "done"
    assert json.loads(status.stdout)["where"] == f"Slurm job {slurm['job_id']}: n1, n2"
    logs = subprocess.run([*tiderl_command(), "logs", job.job_id, "--rank", "2", "--run-root",
                           str(runs)], env=cluster, capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0 and "rank 2 up: actor" in logs.stdout, logs.stderr


def _wait_first_step(run_root: Path, launcher: subprocess.Popen) -> JobRecord:
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
        for path in run_root.glob(f"*/{JOB_FILE}"):
            metrics = path.parent / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                return JobRecord.load(path.parent)
        time.sleep(0.2)
    raise AssertionError("no step within the time a job takes")


def test_tiderl_stop_ends_a_slurm_job_with_its_report(cluster, tmp_path):
    launcher = subprocess.Popen(launch_argv(tmp_path, 500), env=cluster, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        job = _wait_first_step(tmp_path, launcher)
        status = subprocess.run([*tiderl_command(), "status", job.job_id, "--run-root",
                                 str(tmp_path), "--json"], env=cluster, capture_output=True,
                                text=True, timeout=60)
        assert json.loads(status.stdout)["state"] == "running", status.stdout
        stop = subprocess.run([*tiderl_command(), "stop", job.job_id, "--run-root",
                               str(tmp_path)], env=cluster, capture_output=True, text=True,
                              timeout=JOB_S)
        assert stop.returncode == 0, stop.stderr
        assert launcher.wait(JOB_S) != 0  # terminated: the launcher says so, non-zero
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    run_dir = Path(job.run_dir)
    assert (run_dir / "report.md").exists()
    stops = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
             if '"stop"' in line]
    assert stops and stops[-1]["state"] == "stopped"
    steps = JobRecord.load(run_dir).info["slurm"]["steps"]
    queue = subprocess.run(["squeue", "-h", "-s", "-o", "%i"], env=cluster,
                           capture_output=True, text=True).stdout.split()
    assert not set(steps) & set(queue)  # every step of the job has ended


def test_a_dry_run_in_an_allocation_shows_each_nodes_job_step(cluster, tmp_path):
    proc = subprocess.run(launch_argv(tmp_path, 2, "--dry-run", "--json"), env=cluster,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [(p["name"], p["host"]) for p in out["plan"] if p["kind"] == "rank"] == [
        ("rank0", "n1"), ("rank1", "n1"), ("rank2", "n2")]
    assert len(out["srun"]) == 2
    assert all("--nodes=1" in line and "nodectl supervise" in line for line in out["srun"])
    assert "--nodelist=n1" in out["srun"][0] and "--nodelist=n2" in out["srun"][1]
    assert list(tmp_path.iterdir()) == []  # nothing made


def test_what_cannot_run_under_slurm_is_one_line_before_anything_starts(cluster, tmp_path):
    outside = {k: v for k, v in cluster.items() if not k.startswith("SLURM_JOB")}
    line = assert_one_line_error(subprocess.run(
        [*tiderl_command(), "launch", "--slurm", "--run-root", str(tmp_path)], env=outside,
        capture_output=True, text=True, timeout=60), 2)
    assert line.startswith("error: tiderl launch: --slurm: not inside a Slurm allocation")
    for why, nodelist in ((" cannot be expanded: Invalid hostlist: n[3-1]", "n[3-1]"),
                          (": node 'n7': Node n7 not found", "n[1-2,7]")):
        bad = {**outside, "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": nodelist}
        line = assert_one_line_error(subprocess.run(
            [*tiderl_command(), "launch", "--slurm", "--run-root", str(tmp_path)], env=bad,
            capture_output=True, text=True, timeout=60), 2)
        assert line == f"error: tiderl launch: --slurm: SLURM_JOB_NODELIST '{nodelist}'{why}"
    proc = subprocess.run(launch_argv(tmp_path, 2, "--set", "runtime.device=cuda"),
                          env=cluster, capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(proc, 2)
    assert line == ("error: tiderl launch: runtime.device is cuda, but the Slurm allocation has "
                    "no GPUs (SLURM_GPUS_ON_NODE and SLURM_JOB_GPUS are unset): ask for "
                    "--gpus-per-node")
    assert list(tmp_path.iterdir()) == []

