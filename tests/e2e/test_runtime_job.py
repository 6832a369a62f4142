"""Short real jobs: the environment server, the coordinator and rank processes over the CurveZMQ
bus and a gloo world, exactly as ``tiderl launch`` runs them (no mocks)."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
import zmq

from tests.integration.tracking import offline_wandb, tensorboard_scalars, wandb_history
from tiderl.launch.job import run_local
from tiderl.launch.local import JobRecord, group_members, is_running
from tiderl.profile import load_profile
from tiderl.runtime.bus import (
    BusClient,
    Hello,
    JobKeys,
    load_job_keys,
    rank_identity,
)
from tiderl.runtime.report import IMAGES

SMALL = [
    "runtime.num_ranks=3", "runtime.rollout_ranks=2", "job.group_size=4",
    "job.batch_min_groups=1", "job.batch_groups=2", "env.max_turns=4", "engine.max_new_tokens=8",
    "engine.kv_cache_tokens=2048", "env.step_latency.median_s=0.02", "runtime.heartbeat_s=0.5",
    "report.plots=false",  # the report's figures: drawn by the jobs of the tests that read them
]


def _small(steps: int, *extra: str):
    return load_profile("local", [*SMALL, f"job.steps={steps}", *extra])


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _assert_all_gone(run_dir: Path) -> None:
    state = JobRecord.load(run_dir)
    assert len(state.processes) == 5  # env, coordinator, 3 ranks
    for record in state.processes:
        assert not is_running(record.pid), f"{record.name} (pid {record.pid}) is still running"
        assert group_members(record.pid) == [], f"{record.name} left children behind"


def test_a_tiderl_job_trains_every_group_it_finishes_within_the_staleness_bound(tmp_path,
                                                                                monkeypatch):
    """3 steps of system tiderl on one rollout and two actor ranks. ERS's cold start moves the
    spare actor to rollout at launch and back after step 0 (a role switch both ways: it drops
    its engine and gets the weights and the optimizer state); the job goes on to the end.
    Meanwhile a client with other keys knocks on the bus. Its coordinator logs to TensorBoard
    and an offline wandb run too. Its actors train with the decoupled objective."""
    offline_wandb(monkeypatch, tmp_path / "home")
    profile = _small(3, "runtime.rollout_ranks=1", "logging.backends=[jsonl,tensorboard,wandb]",
                     "report.plots=true", "trainer.objective=decoupled",
                     "runtime.cpu_affinity=spread")  # pinned: ERS lends at a cold start
    knockers: list[threading.Thread] = []
    ended = threading.Event()

    def knock(state: JobRecord) -> None:
        def run() -> None:  # it knows the server's public key, not a key of the job
            job = load_job_keys(Path(state.run_dir) / "keys", 0)
            stranger = JobKeys(job.server_public, "rank-0", *zmq.curve_keypair())
            log = Path(state.run_dir) / "logs" / "coordinator.log"
            with BusClient(state.info["bus"], stranger, rank_identity(0)) as client:
                client.send(Hello(rank=0, pid=1, host="x", role="rollout", device="cpu"))
                # connected (it keeps trying) until the coordinator, once up, has turned it away
                while not ended.is_set() and not _rejected_a_peer(log):
                    ended.wait(0.2)
        knockers.append(threading.Thread(target=run, daemon=True))
        knockers[-1].start()

    try:
        result = run_local(profile, run_root=tmp_path, on_start=knock)
    finally:
        ended.set()
    for knocker in knockers:
        knocker.join()
    assert result.exit_code == 0 and result.report is not None and len(knockers) == 1
    metrics = _read(result.run_dir / "metrics.jsonl")
    events = _read(result.run_dir / "events.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    bound = profile.job.max_staleness + profile.job.carry_versions
    assert all(m["staleness_max"] <= bound for m in metrics)
    assert all(4 <= m["trained_samples"] <= 8 and m["trained_samples"] % 4 == 0
               for m in metrics)
    assert all(0 < m["trained_loss_tokens"] < m["trained_tokens"] for m in metrics)
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)
    # every group it fed was trained, dropped, or is still on its way at the end
    (stop,) = [e for e in events if e["kind"] == "stop"]
    groups = stop["groups"]
    assert groups["fed"] == (groups["trained"] + groups["dropped"] + groups["buffered"]
                             + groups["rolling_out"])
    assert groups["trained"] * 4 == sum(m["trained_samples"] for m in metrics)
    # ERS moved rank 2 to rollout at launch and back to the trainer once batch 0 was ready
    moves = [(e["rank"], e["src"], e["dst"]) for e in events if e["kind"] == "role_change"]
    assert moves[:2] == [(2, "actor", "rollout"), (2, "rollout", "actor")]
    assert (metrics[0]["roles"], metrics[0]["ers_reason"]) == (
        ["rollout", "actor", "actor"], "phase_end")
    assert metrics[0]["num_trainer"] == 2  # step 0 trained on the whole trainer
    assert metrics[-1]["version"] == 3

    assert (result.run_dir / "checkpoints" / "step-00000003" / "meta.json").exists()
    # the stranger never got in: the bus rejected it and said so
    log = (result.run_dir / "logs" / "coordinator.log").read_text()
    assert "bus: rejected a peer" in log and "unknown CURVE key" in log
    assert "report.md" in str(result.report)
    assert all((result.run_dir / name).stat().st_size > 0 for name in IMAGES)
    # the same steps in TensorBoard and in the wandb run, and the report links both
    steps = [m["step"] for m in metrics]
    assert [step for step, _ in tensorboard_scalars(result.run_dir / "tensorboard")["loss"]] == \
        steps
    (wandb_run,) = (result.run_dir / "wandb").glob("offline-run-*")
    assert [step for step, _ in wandb_history(next(wandb_run.glob("run-*.wandb")))] == steps
    report = result.report.read_text()
    assert f"tensorboard --logdir {(result.run_dir / 'tensorboard').resolve()}" in report
    assert f"wandb sync {wandb_run.resolve()}" in report
    _assert_all_gone(result.run_dir)  # the wandb service, the coordinator's child, too


def _rejected_a_peer(log: Path) -> bool:
    return log.exists() and "bus: rejected a peer" in log.read_text()


@pytest.mark.parametrize("system", ["sync", "stream"])
def test_the_baseline_systems_run_on_the_same_substrate(tmp_path, system):
    extra = ["runtime.system=sync", "runtime.rollout_ranks=3"] if system == "sync" else \
        ["runtime.system=stream", "job.eval_every=1", "job.eval_groups=1"]
    profile = _small(2, *extra)
    result = run_local(profile, run_root=tmp_path)
    assert result.exit_code == 0
    metrics = _read(result.run_dir / "metrics.jsonl")
    assert len(metrics) == 2
    expected = "batch" if system == "sync" else "vso"  # sync: the whole batch, one swap pair
    assert {m["step_mode"] for m in metrics} == {expected}
    if system == "sync":  # verl: staleness 0, every rank trains
        assert all(m["staleness_max"] == 0 and m["num_trainer"] == 3 for m in metrics)
    else:  # an evaluation per step, each on one anchored version, never trained
        evals = [e for e in _read(result.run_dir / "events.jsonl") if e["kind"] == "eval"]
        assert evals and evals[0]["step"] == 0 and evals[0]["versions"] == [0]
        assert all(len(e["versions"]) == 1 for e in evals)
        assert sum(m["trained_samples"] for m in metrics) == 16  # 2 steps of B_ideal 8
    assert not [e for e in _read(result.run_dir / "events.jsonl") if e["kind"] == "role_change"]
    _assert_all_gone(result.run_dir)
