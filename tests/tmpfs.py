"""A real disk that fills up: a small tmpfs mounted for a test (a full disk's writes fail with
ENOSPC there, as they do on a full disk)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``64k``, ``25m``) mounted at ``folder`` (made here) for the block.
    Mounting needs root or CAP_SYS_ADMIN: where it is refused the test is skipped, naming why."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
