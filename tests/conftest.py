"""Test-wide hooks: tests marked ``gpu`` need a CUDA device (a real vLLM / SGLang server, FSDP on
CUDA, Megatron); on a machine without one they are reported as skipped, never silently passed."""

from __future__ import annotations

import pytest
from hypothesis import settings

# a property test asserts a property, never a time: hypothesis' default 200 ms deadline per
# example failed test_grpo on a machine loaded to 15 (316 ms for its first example)
settings.register_profile("tiderl", deadline=None)
settings.load_profile("tiderl")


def pytest_configure(config: pytest.Config) -> None:
    """The tests that run torch in this process use tiny models: one intra-op thread. Two (the
    default on 2 cores) spin against whatever else runs there: three trainer test files took
    21-76 s with two and 9-17 s with one while other processes shared the cores (on idle cores
    the unit and fuzz tests take about the same either way, 48.6 s vs 47.2 s)."""
    import torch

    torch.set_num_threads(1)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)
