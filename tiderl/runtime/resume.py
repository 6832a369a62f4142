"""A job's checkpoints as a whole, and resuming a job from one.

    runs/<job>/checkpoints/step-00000012/
        job.json          the coordinator's: the step cycle's ResumePoint and the ready groups'
                          samples (written first, at the boundary: write, fsync, rename)
        meta.json, .metadata, *.distcp, rng-rank*.pt
                          the actors' DCP checkpoint (tiderl.trainer.checkpoint; meta.json last)
                          — under megatron TP one such folder per TP index (tp0/, tp1/, ...)
    runs/<job>/resume.json    {"checkpoint": ...}: written by ``tiderl launch --resume``; the
                              coordinator and the ranks of the resumed job read it

A checkpoint is complete when job.json and every part's meta.json are there and the files its
meta.json lists are there at their sizes (a crash or a full disk mid-save leaves one that is
not, and it is never loaded: the one before it is). That check needs no torch: the coordinator
does not import it. The coordinator keeps the newest ``runtime.checkpoint_keep`` complete ones
and removes the rest as it starts the next one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import msgspec

from tiderl.core.step_control import ResumePoint
from tiderl.profile import Profile
from tiderl.runtime.bus import TrainSampleData
from tiderl.runtime.errors import CoordinatorError
from tiderl.trainer.checkpoint_meta import (
    META_FILE,
    CheckpointError,
    file_problem,
    read_meta,
    step_dir,
    step_folders,
)

log = logging.getLogger("tiderl.coordinator")

JOB_STATE = "job.json"
RESUME_FILE = "resume.json"
CHECKPOINTS = "checkpoints"


class ReadyGroupState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A ready group of the checkpoint: its dataset index, samples and rewards (task order)."""

    group_id: str
    index: int
    step: int
    samples: list[TrainSampleData]
    rewards: list[float]


class CheckpointState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    point: ResumePoint
    ready: list[ReadyGroupState]
    schema: int = 1


def write_checkpoint_state(folder: Path, state: CheckpointState) -> Path:
    """``folder/job.json``, atomically: a crash leaves the old file or none, never half."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / JOB_STATE
    write_atomic(path, msgspec.json.encode(state))
    return path


def read_checkpoint_state(folder: Path) -> CheckpointState:
    path = folder / JOB_STATE
    try:
        return msgspec.json.decode(path.read_bytes(), type=CheckpointState)
    except FileNotFoundError:
        raise CheckpointError(f"no complete checkpoint at {folder}: {JOB_STATE} is missing") \
            from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"unreadable {path}: {exc}") from None


def parts(folder: Path, tensor_parallel: int) -> list[Path]:
    """The folders the actors' DCP checkpoints are in: the step folder, or one per TP index."""
    return [folder] if tensor_parallel == 1 else [folder / f"tp{i}"
                                                   for i in range(tensor_parallel)]


def check_complete(folder: Path, tensor_parallel: int) -> int:
    """The version of a complete checkpoint at ``folder``; CheckpointError naming what is
    missing or short otherwise."""
    state = read_checkpoint_state(folder)
    for part in parts(folder, tensor_parallel):
        meta = read_meta(part)
        if meta.version != state.point.version:
            raise CheckpointError(f"{part / META_FILE} is of version {meta.version}, "
                                  f"{JOB_STATE} of {state.point.version}")
        problem = file_problem(part, meta) if meta.files else _dcp_file_problem(part)
        if problem is not None:
            raise CheckpointError(problem)
    return state.point.version


def _dcp_file_problem(part: Path) -> str | None:
    """For a checkpoint whose meta.json lists no files (written before it did): every DCP
    storage file is there and as long as the metadata's last byte in it (this reads the DCP
    metadata, with torch)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(part)).read_metadata()
    except Exception as exc:  # whatever makes the metadata unreadable: not loadable
        return f"unreadable DCP metadata in {part}: {exc}"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in needed.items():
        path = part / name
        size = path.stat().st_size if path.is_file() else -1
        if size < end:
            what = "missing" if size < 0 else f"{size} bytes, its metadata needs {end}"
            return f"incomplete checkpoint at {part}: {name} is {what}"
    return None


@dataclass(frozen=True)
class Choice:
    folder: Path
    version: int
    skipped: tuple[str, ...]  # newer checkpoints passed over, each with why


def latest_complete(root: Path, tensor_parallel: int) -> Choice:
    """The newest complete checkpoint under ``root`` (the ones passed over, and why)."""
    skipped = []
    for folder in step_folders(root):
        try:
            version = check_complete(folder, tensor_parallel)
        except (CheckpointError, OSError) as exc:
            skipped.append(f"{folder.name}: {exc}")
            continue
        return Choice(folder, version, tuple(skipped))
    why = "; ".join(skipped) if skipped else "there is none"
    raise CheckpointError(f"no complete checkpoint under {root} ({why})")


def prune(root: Path, keep: int, tensor_parallel: int, starting: Path) -> list[Path]:
    """Before the checkpoint ``starting`` is written: keep the newest ``keep - 1`` complete
    ones, remove the older and the incomplete ones. Returns the removed folders."""
    removed, kept = [], 0
    for folder in step_folders(root):
        if folder == starting:
            continue
        try:
            check_complete(folder, tensor_parallel)
            is_complete = True
        except (CheckpointError, OSError):
            is_complete = False
        if is_complete and kept < keep - 1:
            kept += 1
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def resume_hint(run_dir: Path, tensor_parallel: int, default_root: str = "runs") -> str:
    """The line that resumes this job from its newest complete checkpoint ("" if none)."""
    try:
        choice = latest_complete(run_dir / CHECKPOINTS, tensor_parallel)
    except CheckpointError:
        return ""
    is_default = run_dir.parent.resolve() == Path(default_root).resolve()
    job = run_dir.name if is_default else str(run_dir)
    return (f"resume it from {choice.folder.name} (step {choice.version}) with: "
            f"tiderl launch --resume {job}")


def space_shortfall(root: Path, starting: Path) -> str:
    """Why the checkpoint ``starting`` would not fit under ``root`` ("" if it would, or if
    there is no checkpoint before it to size it by): it needs what the newest one took."""
    previous = [f for f in step_folders(root) if f != starting]
    if not previous:
        return ""
    need = sum(f.stat().st_size for f in previous[0].rglob("*") if f.is_file())
    free = shutil.disk_usage(root).free
    if free >= need * 1.1:
        return ""
    return (f"{free / 2**20:.1f} MiB free at {root}, the last checkpoint took "
            f"{need / 2**20:.1f} MiB")


def write_resume_request(run_dir: Path, folder: Path) -> None:
    write_atomic(run_dir / RESUME_FILE, json.dumps({"checkpoint": str(folder)}).encode())


def resume_request(run_dir: Path) -> Path | None:
    """The checkpoint this job resumes from (None: a fresh job)."""
    path = run_dir / RESUME_FILE
    if not path.is_file():
        return None
    return Path(json.loads(path.read_text())["checkpoint"])


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never a part (write, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_checkpoint(root: Path, version: int, profile: Profile, state: CheckpointState) -> Path:
    """The folder of version ``version``'s checkpoint, begun: the older ones pruned to
    ``runtime.checkpoint_keep``, then ``job.json`` (the actors' meta.json completes it).
    CoordinatorError when it would not fit: stop before the actors fill the disk mid-save."""
    keep, tensor_parallel = profile.runtime.checkpoint_keep, profile.trainer.tensor_parallel

    folder = step_dir(root, version)
    for old in prune(root, keep, tensor_parallel, folder):
        log.info("removed checkpoint %s", old)
    shortfall = space_shortfall(root, folder)
    if shortfall:
        raise CoordinatorError(f"no disk space for checkpoint {folder.name}: {shortfall}")
    write_checkpoint_state(folder, state)
    return folder
