"""A real job on the FSDP2 trainer backend: `tiderl launch --set trainer.backend=fsdp2` with a
rank moved out of training and back in by `tiderl rebalance` (each move rebuilds the actors'
FSDP2 wrap for the new actor set), HF folders exported during the run and at its end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.running_job import running_job
from tests.integration.test_rebalance import kinds, read, rebalance_applied, tiderl_here
from tiderl.models.loading import load_model

# `tiderl rebalance` runs in this process: a new interpreter took seconds to start on a loaded
# machine while the job went on, and 24 steps were needed for both moves to land before the end.
# The first plan goes after step 0, the second once the first is applied: they land at versions
# 2 and 3 (3 and 4 on a machine loaded to 11, where a step takes about a second)
STEPS = 10
EXPORT_EVERY = 4  # HF folders at 4 and 8, on the cadence, and at 10, the end, off it


def test_an_fsdp2_job_trains_through_rebalance_moves_and_exports_hf_folders(tmp_path):
    runs = tmp_path / "runs"
    with running_job(runs, "trainer.backend=fsdp2", f"trainer.export_every={EXPORT_EVERY}",
                     "ra2p.placement=colocated", "trainer.lr_schedule=cosine",
                     "trainer.warmup_steps=2", steps=STEPS, wait_steps=1,
                     timeout_s=240) as (state, launcher):
        args = ("--run-root", str(runs))
        # an actor leaves for rollout, and comes back: a joiner
        out = rebalance_applied(state.job_id, "2", "1", args, run=tiderl_here)
        back = rebalance_applied(state.job_id, "1", "2", args, run=tiderl_here)
        assert out["version"] < back["version"] < STEPS, (out, back)  # a step after each
        assert launcher.wait(240) == 0, (runs / "launcher.log").read_text()[-2000:]
    run_dir = Path(state.run_dir)
    records = read(run_dir, "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    trainers = {r["step"]: r["num_trainer"] for r in records}
    assert trainers[out["version"]] == 1 and trainers[back["version"]] == 2
    # after training began, an actor left and one joined (by these plans, or by ERS's own
    # plan when it had already formed the asked-for layout)
    moves = {(e["src"], e["dst"]) for e in kinds(run_dir, "role_change") if e["version"] > 0}
    assert {("actor", "rollout"), ("rollout", "actor")} <= moves
    assert all(r["trained_loss_tokens"] > 0 for r in records)

    exports = sorted(p.name for p in (run_dir / "hf").iterdir() if not p.name.startswith("."))
    versions = sorted({*range(EXPORT_EVERY, STEPS + 1, EXPORT_EVERY), STEPS})
    assert exports == [f"step-{v:08d}" for v in versions]
    final = run_dir / "hf" / f"step-{STEPS:08d}"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in
                                                                       final.iterdir()}
    ours = load_model(final)  # what `tiderl engine serve --model` loads
    first = load_model(run_dir / "hf" / f"step-{EXPORT_EVERY:08d}")
    assert not torch.equal(ours.lm_head.weight, first.lm_head.weight)  # training went on
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=1e-4, rtol=1e-4)
