"""The C++ kernels in tests: a test that needs them skips on a machine without a C++ compiler,
and fails under CI (``CI`` set), whose set-up installs one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tiderl.engine.kernels import KernelsUnavailable


@contextmanager
def native_or_skip() -> Iterator[None]:
    """Run the block; if it finds the kernels unavailable, skip (fail under CI)."""
    try:
        yield
    except KernelsUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the C++ kernels: {exc}")
        pytest.skip(str(exc))
