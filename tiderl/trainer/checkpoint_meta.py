"""The torch-free half of :mod:`tiderl.trainer.checkpoint`: folder names, the ``meta.json``
marker of a complete checkpoint and reading it (what the launcher and the coordinator need,
without importing torch)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

META_FILE = "meta.json"
STEP_PATTERN = re.compile(r"^step-(\d{8})$")
PART_FILE = re.compile(r"^(\.metadata|.+\.distcp|rng-rank\d+\.pt)$")  # what the actors write


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable; the message names its path."""


@dataclass(frozen=True)
class CheckpointMeta:
    version: int
    extra: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    backend: str = ""
    rng_restored: bool = False  # False when loaded on another world size (RNG is per rank)
    files: dict[str, int] = field(default_factory=dict)  # the part's files and their sizes


def step_dir(path: str | Path, version: int) -> Path:
    return Path(path) / f"step-{version:08d}"


def read_meta(folder: str | Path) -> CheckpointMeta:
    """The meta of a complete checkpoint; ``CheckpointError`` when there is none at ``folder``."""
    meta_file = Path(folder) / META_FILE
    if not meta_file.is_file():
        what = "does not exist" if not Path(folder).exists() else "has no meta.json (incomplete)"
        raise CheckpointError(f"no complete checkpoint at {folder}: the folder {what}")
    try:
        data = json.loads(meta_file.read_text())
        return CheckpointMeta(int(data["version"]), dict(data["extra"]), int(data["world_size"]),
                              str(data["backend"]),
                              files={str(k): int(v) for k, v in data.get("files", {}).items()})
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable {meta_file}: {exc}") from None


def part_files(folder: Path) -> dict[str, int]:
    """The files the actors wrote into a checkpoint folder, with their sizes."""
    return {f.name: f.stat().st_size for f in sorted(folder.iterdir())
            if PART_FILE.match(f.name) and f.is_file()}


def file_problem(folder: Path, meta: CheckpointMeta) -> str | None:
    """Why the files ``meta`` lists are not all there at their sizes (None: they are)."""
    for name, size in meta.files.items():
        path = folder / name
        found = path.stat().st_size if path.is_file() else -1
        if found != size:
            what = "missing" if found < 0 else f"{found} bytes, {META_FILE} says {size}"
            return f"incomplete checkpoint at {folder}: {name} is {what}"
    return None


def step_folders(path: str | Path) -> list[Path]:
    """The ``step-N`` folders under ``path``, newest first."""
    root = Path(path)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in root.iterdir()
             if (m := STEP_PATTERN.match(child.name)) and child.is_dir()]
    return [folder for _, folder in sorted(found, reverse=True)]


def latest_checkpoint(path: str | Path) -> Path | None:
    """The complete checkpoint under ``path`` with the highest version, or None."""
    return next((f for f in step_folders(path) if (f / META_FILE).is_file()), None)
