"""The rollout/train boundary recorded and replayed by real jobs (``tiderl launch``'s own
run_local: the coordinator and rank processes over the bus and a gloo world): a job records its
batches, other jobs train them again with no rollout, and one rolls out without training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from msgspec.structs import replace

from tests.e2e.test_runtime_job import SMALL
from tiderl.core.system import StepMode
from tiderl.launch.job import JobResult, run_local
from tiderl.launch.local import JobRecord
from tiderl.models.loading import load_model, model_from_config
from tiderl.profile import load_profile
from tiderl.runtime.recording import RecordedStart, read_step, step_file

STEPS = 2
EXPORT = f"hf/step-{STEPS:08d}"  # the weights after the last step


def _small(*extra: str):
    return load_profile("local", [*SMALL, f"job.steps={STEPS}", *extra])


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_model(folder).state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> JobResult:
    """A job of system tiderl that records its batches; its steps train on two actors (ranks 1
    and 2: ERS lends rank 2 to rollout at launch and takes it back before step 0)."""
    result = run_local(_small("logging.batches=true", "runtime.rollout_ranks=1"),
                       run_root=tmp_path_factory.mktemp("recorded"))
    assert result.exit_code == 0
    return result


def test_a_replay_trains_each_recorded_step_to_its_recorded_loss(recorded, tmp_path):
    """The same loss exactly, not to a tolerance: each step runs its recorded micro-batches in
    their order on the same actor ranks (the same shares, the same gloo reductions in the same
    order) from the same weights, and nothing a rank computes depends on when a micro-batch
    arrives. The weights it ends with are the recording job's, bit for bit."""
    batches = recorded.run_dir / "batches"
    steps = [read_step(batches, step) for step in range(STEPS)]
    losses = [step.loss for step in steps]
    assert all(step.is_trained and step.loss_tokens for step in steps)
    assert [m["loss"] for m in _read(recorded.run_dir / "metrics.jsonl")] == \
        [round(loss, 4) for loss in losses]

    # a recording of another shape: refused in one line before anything starts
    proc = subprocess.run(
        [sys.executable, "-m", "tiderl.cli.main", "launch", "--run-root", str(tmp_path / "x"),
         *(f"--set={s}" for s in [*SMALL, f"job.steps={STEPS}", "job.group_size=8",
                                  f"runtime.replay={recorded.run_dir}"])],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"error: tiderl launch: runtime.replay: {batches} step 0 was "
                                   "recorded with job.group_size 4, this job has 8")
    assert not (tmp_path / "x").exists()

    replayed = run_local(_small(f"runtime.replay={recorded.run_dir}", "logging.batches=true",
                                "runtime.rollout_ranks=1"), run_root=tmp_path)
    assert replayed.exit_code == 0
    assert [(e["step"], e["loss"], e["recorded_loss"], e["difference"])
            for e in _read(replayed.run_dir / "events.jsonl") if e["kind"] == "replayed"] == \
        [(step, loss, loss, 0.0) for step, loss in enumerate(losses)]
    metrics = _read(replayed.run_dir / "metrics.jsonl")
    assert [(m["loss"], m["recorded_loss"]) for m in metrics] == \
        [(round(loss, 4), round(loss, 4)) for loss in losses]
    assert [s.start.actor_ranks for s in steps] == [[1, 2]] * STEPS
    assert [m["step_mode"] for m in metrics] == [s.start.step_mode.value for s in steps]
    # each step ran on its recorded batches and ranks: its own recording holds the same
    again = [read_step(replayed.run_dir / "batches", step) for step in range(STEPS)]
    assert [(s.start, s.micro_batches, s.loss) for s in again] == \
        [(s.start, s.micro_batches, s.loss) for s in steps]
    # no environment service, no rollout: the recording's rollout rank idled
    kinds = [p.kind for p in JobRecord.load(replayed.run_dir).processes]
    assert sorted(kinds) == ["coordinator", "rank", "rank", "rank"]
    assert all(m["roles"][0] == "idle" and m["num_rollout"] == 0 for m in metrics)

    recorded_weights = _weights(recorded.run_dir / EXPORT)
    assert _same(_weights(replayed.run_dir / EXPORT), recorded_weights)
    initial, _ = model_from_config(_small().model)
    assert not _same(recorded_weights, initial.state_dict())  # training moved them


def test_a_replay_takes_each_steps_layout_at_a_boundary(recorded, tmp_path):
    """A recording whose step 1 ran decoupled on rank 1 with rank 2 as its Ref (edited here: the
    small job's ERS keeps it colocated), replayed by a job that launches rank 1 idle: a boundary
    before step 0 makes rank 1 an actor, one before step 1 makes rank 2 the Ref, with the weights
    of version 1. Step 1's loss agrees to 1e-6, not exactly: one actor sums what two did."""
    edited = tmp_path / "edited"
    edited.mkdir()
    for step in range(STEPS):
        batches = read_step(recorded.run_dir / "batches", step)
        if step == 1:
            batches = replace(batches, start=RecordedStart(StepMode.DECOUPLED, [2], [1], 1, 0))
        step_file(edited, step).write_bytes(msgspec.msgpack.encode(batches))
    result = run_local(_small(f"runtime.replay={edited}", "runtime.rollout_ranks=2"),
                       run_root=tmp_path)
    assert result.exit_code == 0
    events = _read(result.run_dir / "events.jsonl")
    assert events[0]["roles"] == ["idle", "idle", "actor"]
    assert [(e["rank"], e["src"], e["dst"], e["version"]) for e in events
            if e["kind"] == "role_change"] == [(2, "actor", "ref", 1)]
    (first, second) = [e for e in events if e["kind"] == "replayed"]
    assert first["difference"] == 0.0 and abs(second["difference"]) < 1e-6
    metrics = _read(result.run_dir / "metrics.jsonl")
    assert [(m["step_mode"], m["roles"]) for m in metrics] == [
        ("colocated", ["idle", "actor", "actor"]), ("decoupled", ["idle", "actor", "ref"])]


def test_a_roll_out_only_job_forms_its_batches_and_leaves_the_weights_as_they_were(tmp_path):
    result = run_local(_small("runtime.train=false", "logging.batches=true"), run_root=tmp_path)
    assert result.exit_code == 0
    metrics = _read(result.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(not m["is_trained"] and m["loss"] is None and m["trained_samples"] > 0
               for m in metrics)
    steps = [read_step(result.run_dir / "batches", step) for step in range(STEPS)]
    assert all(not s.is_trained and s.loss is None and s.micro_batches for s in steps)
    initial, _ = model_from_config(_small().model)
    assert _same(_weights(result.run_dir / EXPORT), initial.state_dict())
