"""Checkpoints of the actor: model, optimizer, version and RNG, resumable bit-exactly.

Layout of one checkpoint (``torch.distributed.checkpoint``, so FSDP2 shards are saved as shards
and can be loaded on another world size)::

    <path>/step-00000012/
        .metadata, __0_0.distcp, __1_0.distcp, ...   DCP: {"model": ..., "optim": ...}
        rng-rank0.pt, rng-rank1.pt, ...              each rank's torch / CUDA / python RNG
        meta.json                                    written last: the "complete" marker

``meta.json`` is written by rank 0 of the backend's group after a barrier that every rank passes
only once its files are written, so a checkpoint with ``meta.json`` is complete and one without
it (a crash mid-save) is never loaded; it lists those files with their sizes, so that a file
cut short or lost later is found without torch (``checkpoint_meta.file_problem``). Works
without a process group too (single process).
"""

from __future__ import annotations

import json
import os
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiderl.trainer.checkpoint_meta import (
    META_FILE,
    STEP_PATTERN,
    CheckpointError,
    CheckpointMeta,
    latest_checkpoint,
    part_files,
    read_meta,
    step_dir,
)
from tiderl.trainer.parallel import TrainBackend

__all__ = ["META_FILE", "STEP_PATTERN", "CheckpointError", "CheckpointMeta", "latest_checkpoint",
           "load_checkpoint", "read_meta", "save_checkpoint", "step_dir"]


def save_checkpoint(path: str | Path, backend: TrainBackend, optimizer: torch.optim.Optimizer,
                    version: int, extra: dict[str, Any] | None = None) -> Path:
    """Save under ``path/step-{version:08d}``; every rank of ``backend.group`` must call this.
    ``extra`` (JSON-serialisable, e.g. buffer and dataset position) is stored in meta.json."""
    import torch.distributed.checkpoint as dcp  # here: it takes a rank ~1 s to import
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = step_dir(path, version)
    rank, world_size = _rank_and_size(backend.group)
    meta = {"version": version, "extra": extra or {}, "world_size": world_size,
            "backend": backend.name}
    json.dumps(meta)  # fails here, before any file, if extra is not JSON
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        # An older save of this version stops counting as complete. No other rank writes into
        # the folder before rank 0 joins dcp.save's first collective, which is after this.
        (folder / META_FILE).unlink(missing_ok=True)
    model_state, optim_state = get_state_dict(backend.module, optimizer)
    with _single_process_ok():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder,
                 process_group=backend.group)
    torch.save(_rng_state(), folder / f"rng-rank{rank}.pt")
    _barrier(backend.group)
    if rank == 0:  # write, fsync, rename: the marker is whole or absent
        tmp = folder / f"{META_FILE}.tmp"
        with open(tmp, "w") as handle:
            handle.write(json.dumps({**meta, "files": part_files(folder)}, indent=2) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, folder / META_FILE)
    _barrier(backend.group)  # no rank returns before the checkpoint is complete
    return folder


def load_checkpoint(path: str | Path, backend: TrainBackend,
                    optimizer: torch.optim.Optimizer) -> CheckpointMeta:
    """Load a complete checkpoint folder (as ``save_checkpoint`` / ``latest_checkpoint`` return
    it) into ``backend`` and ``optimizer`` in place, and restore this rank's RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(path)
    meta = read_meta(folder)
    rank, world_size = _rank_and_size(backend.group)
    rng_file = folder / f"rng-rank{rank}.pt"
    restore_rng = meta.world_size == world_size
    if restore_rng and not rng_file.is_file():
        raise CheckpointError(f"incomplete checkpoint at {folder}: {rng_file.name} is missing")
    model_state, optim_state = get_state_dict(backend.module, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=folder, process_group=backend.group)
    set_state_dict(backend.module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    if restore_rng:
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return CheckpointMeta(meta.version, meta.extra, meta.world_size, meta.backend, restore_rng)


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns on every save/load without a process group; for us that is a supported mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
