"""The rollout/train boundary recorded by real jobs (``tiderl launch``'s own run_local: the
environment service, the coordinator and rank processes over the bus and a gloo world): a job
that rolls out without training records its batches and leaves the weights as they were."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.e2e.test_runtime_job import SMALL
from tiderl.launch.job import run_local
from tiderl.models.loading import load_model, model_from_config
from tiderl.profile import load_profile
from tiderl.runtime.recording import read_step

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
