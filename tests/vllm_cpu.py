"""A real vLLM server for the tests: vLLM's CPU backend as `make vllm-cpu` builds it
(tools/vllm_cpu.py), started with the launch plan's own command line. The tests that need it
carry the ``vllm`` mark (`make test-vllm`) and skip where the build is absent."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.serving import free_port, process_exit, stop_process, wait_healthy
from tiderl.launch.plan import engine_command
from tiderl.profile import Profile
from tools.vllm_cpu import VLLM_VERSION, cache_root

VLLM_PYTHON = cache_root() / "venv" / "bin" / "python"
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(
    not (VLLM_PYTHON.with_name("vllm").exists() and (cache_root() / ".check.done").exists()),
    reason=f"no vLLM {VLLM_VERSION} CPU build at {cache_root()} (make vllm-cpu)")]


def vllm_overrides() -> list[str]:
    """Profile overrides that run a job's engine servers on the CPU build."""
    return ["engine.backend=vllm", f"engine.server_python={VLLM_PYTHON}"]


@contextlib.contextmanager
def vllm_serving(profile: Profile, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``vllm serve`` of ``profile``'s model, as a job starts it on a CPU rank, until /health
    answers 200 (a start takes about a minute on 2 cores); yields (base URL, process)."""
    port = free_port()
    argv, env = engine_command(profile, str(VLLM_PYTHON), str(log.parent), port, "cpu")
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process_exit(proc, log))
            yield url, proc
        finally:
            stop_process(proc, grace_s=30)
