"""A policy version as an HF-format folder: for engine servers that load weights from disk
(``engine.weight_sync: disk``), and every ``trainer.export_every`` steps and at the end of a job
for the user (loadable by transformers, ``tiderl engine serve`` and vLLM / SGLang):

    runs/<job>/weights/v00000003/  config.json  model.safetensors (or shards + index)
                                   tokenizer.json (and the model folder's tokenizer
                                   config, chat template and generation config)
    runs/<job>/hf/step-00000004/   the same files; kept (not pruned)

A version is written into a hidden folder beside its place and renamed into it, so a reader sees
the whole version or nothing. Ranks of one node share the folder: the first to take the
version's lock file (``flock``, released if the writer dies) writes it, the others wait and find
it there. After each export the newest ``keep`` versions stay and older ones are removed (a
server still loading one is at most one version behind: keep at least 2).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tiderl.models.folder import TOKENIZER_FILE, copy_tokenizer_extras, save_state_dict
from tiderl.models.qwen2 import Qwen2Config

VERSION_DIR = re.compile(r"^v(\d{8})$")


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def export_version(state: dict[str, torch.Tensor], config: Qwen2Config, tokenizer: Tokenizer,
                   root: str | Path, version: int, keep: int = 2,
                   max_shard_bytes: int | None = None,
                   source: str | Path | None = None) -> Path:
    """Write ``state`` as version ``version``'s folder under ``root`` (unless a rank of this
    node already did) and prune to the newest ``keep``; returns the folder."""
    final = version_dir(root, version)
    write_folder(state, config, tokenizer, final, max_shard_bytes, source)
    prune(root, keep)
    return final


def write_folder(state: dict[str, torch.Tensor], config: Qwen2Config, tokenizer: Tokenizer,
                 final: Path, max_shard_bytes: int | None = None,
                 source: str | Path | None = None) -> Path:
    """``state`` as the HF folder ``final``, unless it is there already: written beside it and
    renamed into place under a lock file (``flock``) that writers of one node share. ``source``:
    the model folder the job started from, whose tokenizer extras go along."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a rank of this node writing it: wait for it
        if not final.is_dir():
            tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            save_state_dict(state, config, tmp, max_shard_bytes)
            tokenizer.save(str(tmp / TOKENIZER_FILE))
            copy_tokenizer_extras(source, tmp)
            tmp.rename(final)
    return final


def versions(root: str | Path) -> list[int]:
    """The versions exported under ``root``, oldest first."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    found = (VERSION_DIR.match(entry.name) for entry in folder.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def prune(root: str | Path, keep: int) -> None:
    for version in versions(root)[:-keep]:
        with contextlib.suppress(FileNotFoundError):  # a rank of this node removed it first
            shutil.rmtree(version_dir(root, version))
            (Path(root) / f".{version_dir(root, version).name}.lock").unlink()
