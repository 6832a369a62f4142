"""Test-wide hooks: tests marked ``gpu`` need a CUDA device (a real vLLM / SGLang server, FSDP on
CUDA, Megatron); on a machine without one they are reported as skipped, never silently passed."""

from __future__ import annotations

import pytest


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
