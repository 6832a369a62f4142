"""A real `tiderl ... serve` process for integration tests: a free loopback port, start, wait for
/health, and always stop it (terminate, then kill after a grace period).

``wait_healthy`` is the one wait on a started server in the tests: it follows the server, not a
clock. It fails as soon as the server has exited (with its log's tail) and waits as long as it
lives, however slow the machine; only a start that hangs for ``HUNG_START_S`` fails on time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from tiderl.ports import free_port


def tiderl_command() -> list[str]:
    script = Path(sys.executable).with_name("tiderl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tiderl.cli.main"]


HUNG_START_S = 600.0  # not a slow start (a loaded machine takes 30 s and more): a hung one
LOG_TAIL_CHARS = 4000


@contextlib.contextmanager
def serving(args: list[str], port: int, log_path: Path,
            env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``tiderl *args`` (which must listen on ``port``; ``env`` added to this process's
    environment) until its /health answers 200; yields (base URL, process)."""
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*tiderl_command(), *args], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        try:
            wait_healthy(url, process_exit(proc, log_path))
            yield url, proc
        finally:
            stop_process(proc)


def wait_healthy(url: str, exited: Callable[[], str | None],
                 hung_s: float = HUNG_START_S) -> None:
    """Until ``url``/health answers 200 (a 503 while the server loads is waited through).
    ``exited()`` says why the server is gone (None while it runs): the wait fails with it at
    once."""
    started = time.monotonic()
    # one client for every poll: each new one loads the CA bundle (40 ms of CPU, taken from the
    # server that is starting)
    with httpx.Client(timeout=5) as http:
        while True:
            reason = exited()
            assert reason is None, (f"the server at {url} is gone before answering /health: "
                                    f"{reason}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(f"{url}/health").status_code == 200:
                    return
            waited = time.monotonic() - started
            assert waited < hung_s, (f"the server at {url} runs but has not answered /health "
                                     f"200 in {waited:.0f} s")
            time.sleep(0.1)


def process_exit(proc: subprocess.Popen, log_path: Path | None = None
                 ) -> Callable[[], str | None]:
    """For :func:`wait_healthy`: None while ``proc`` runs, else its exit code and the tail of
    its log (stdout and stderr)."""
    def exited() -> str | None:
        code = proc.poll()
        if code is None:
            return None
        tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log_path else ""
        return f"exit code {code}\n{tail}"
    return exited


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def env_serving(root: Path, envs: str, *args: str,
                env: dict[str, str] | None = None) -> Iterator[dict]:
    """``tiderl env serve --envs ENVS *args`` on a free port until the block ends (``env`` added
    to its environment); yields {"url", "proc", "log"}."""
    port, log = free_port(), root / "server.log"
    with serving(["env", "serve", "--envs", envs, "--port", str(port), *args], port, log,
                 env) as (url, proc):
        yield {"url": url, "proc": proc, "log": log}


def run_env_scenario(url: str, scenario):
    """``await scenario(client)`` with an HTTPEnvClient of the service at ``url`` (one retry)."""
    from tiderl.env.client import HTTPEnvClient

    async def main():
        async with HTTPEnvClient(url, retries=1, backoff_s=0.01) as client:
            return await scenario(client)
    return asyncio.run(main())
