"""Job checkpoints on disk: what counts as complete, the fallback past a broken one, pruning,
and the space check; real DCP saves of a small model and real job.json files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiderl.core.step_control import ResumePoint
from tiderl.core.step_control.state import GroupCount
from tiderl.core.types import Placement, Role
from tiderl.runtime.resume import (
    CheckpointState,
    check_complete,
    latest_complete,
    prune,
    read_checkpoint_state,
    resume_hint,
    space_shortfall,
    write_checkpoint_state,
)
from tiderl.trainer.checkpoint import CheckpointError, save_checkpoint, step_dir
from tiderl.trainer.parallel import make_backend


def point(version: int) -> ResumePoint:
    return ResumePoint(
        version=version, elapsed_s=1.5 * version, roles=(Role.ROLLOUT, Role.ACTOR), num_fed=4,
        ready=(), in_flight=(), trained_tokens=0, trained_samples=0, failed_samples=0,
        num_retired=0, discarded_tokens=0, discarded_groups=0, discarded_samples=0,
        generated_tokens=0, tasks_per_step=4, placement=Placement.COLOCATED, eval_fed_at=-1,
        groups=GroupCount())


def checkpoint(root: Path, version: int) -> Path:
    """A job checkpoint as a job writes one: job.json first, then the actor's DCP save."""
    folder = step_dir(root, version)
    write_checkpoint_state(folder, CheckpointState(point(version), []))
    model = torch.nn.Linear(64, 64)
    backend = make_backend("ddp", model, None)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(root, backend, optimizer, version)
    return folder


def test_a_complete_checkpoint_reads_back_and_the_newest_wins(tmp_path):
    for version in (2, 4):
        checkpoint(tmp_path, version)
    assert check_complete(step_dir(tmp_path, 4), 1) == 4
    choice = latest_complete(tmp_path, 1)
    assert (choice.version, choice.skipped) == (4, ())
    assert read_checkpoint_state(choice.folder).point == point(4)


@pytest.mark.parametrize("damage", ["truncated shard", "no rng", "no meta", "no job state",
                                    "bad json", "truncated shard, meta of before file lists"])
def test_a_damaged_newest_checkpoint_is_passed_over_with_the_reason(tmp_path, damage):
    checkpoint(tmp_path, 2)
    newest = checkpoint(tmp_path, 4)
    if damage.startswith("truncated shard"):
        shard = next(newest.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
        if damage.endswith("file lists"):  # a checkpoint of an older TideRL: DCP's metadata
            meta = json.loads((newest / "meta.json").read_text())
            del meta["files"]
            (newest / "meta.json").write_text(json.dumps(meta))
    elif damage == "no rng":
        (newest / "rng-rank0.pt").unlink()
    elif damage == "no meta":
        (newest / "meta.json").unlink()
    elif damage == "no job state":
        (newest / "job.json").unlink()
    else:
        (newest / "job.json").write_text("{\"point\": ")
    choice = latest_complete(tmp_path, 1)
    assert choice.version == 2
    (why,) = choice.skipped
    assert why.startswith("step-00000004: ")


def test_no_complete_checkpoint_is_one_line_naming_each_reason(tmp_path):
    folder = checkpoint(tmp_path, 2)
    (folder / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint under .* \(step-00000002"):
        latest_complete(tmp_path, 1)
    assert resume_hint(tmp_path.parent / "nojob", 1) == ""


def test_pruning_keeps_the_newest_and_drops_the_broken(tmp_path):
    for version in (2, 4, 6):
        checkpoint(tmp_path, version)
    (step_dir(tmp_path, 4) / "meta.json").unlink()  # incomplete: goes first
    starting = step_dir(tmp_path, 8)
    removed = prune(tmp_path, 2, 1, starting)
    assert sorted(p.name for p in removed) == ["step-00000002", "step-00000004"]
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000006"]


def test_the_space_check_sizes_the_next_checkpoint_by_the_last(tmp_path):
    assert space_shortfall(tmp_path, step_dir(tmp_path, 2)) == ""  # nothing to size it by
    checkpoint(tmp_path, 2)
    assert space_shortfall(tmp_path, step_dir(tmp_path, 4)) == ""  # a disk with room
