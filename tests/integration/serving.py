"""A real `tiderl ... serve` process for integration tests: a free loopback port, start, wait for
/health, and always stop it (terminate, then kill after a grace period)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiderl_command() -> list[str]:
    script = Path(sys.executable).with_name("tiderl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tiderl.cli.main"]


@contextlib.contextmanager
def serving(args: list[str], port: int, log_path: Path, timeout_s: float = 30.0,
            env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``tiderl *args`` (which must listen on ``port``; ``env`` added to this process's
    environment); yields (base URL, process)."""
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*tiderl_command(), *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        try:
            _wait_healthy(url, proc, log_path, timeout_s)
            yield url, proc
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log_path.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        assert time.monotonic() < deadline, f"server did not answer /health in {timeout_s:.0f} s"
        time.sleep(0.2)


def run_env_scenario(url: str, scenario):
    """``await scenario(client)`` with an HTTPEnvClient of the service at ``url`` (one retry)."""
    from tiderl.env.client import HTTPEnvClient

    async def main():
        async with HTTPEnvClient(url, retries=1, backoff_s=0.01) as client:
            return await scenario(client)
    return asyncio.run(main())
