"""The environment client against a real `tiderl env serve` that fails: a 5xx now and then, a
stalled process (SIGSTOP), a crash and a restart. Retries are bounded, /observation is retried
only when it never reached the server, and no call outlives its deadline."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.serving import (
    free_port,
    process_exit,
    serving,
    stop_process,
    tiderl_command,
    wait_healthy,
)
from tiderl.env.client import EnvClientError, HTTPEnvClient

ROOT = Path(__file__).resolve().parents[2]
FLAKY = "tests.integration.flaky_env:FlakyGuessEnv"


def env_args(port: int, envs: str = "guess") -> list[str]:
    return ["env", "serve", "--envs", envs, "--port", str(port)]


def test_5xx_on_start_is_retried_and_the_episode_goes_on(tmp_path):
    port = free_port()
    with serving(env_args(port, f"guess,{FLAKY}"), port, tmp_path / "server.log",
                 env={"PYTHONPATH": str(ROOT)}) as (url, _):
        async def scenario():
            async with HTTPEnvClient(url, retries=2, backoff_s=0.01) as client:
                started = await client.start(FLAKY, "1 10", seed=1)  # 500, then 200
                out = await client.step(started.session, "guess 5")
                await client.end(started.session)
            async with HTTPEnvClient(url, retries=0) as once:
                with pytest.raises(EnvClientError, match=r"/start failed \(500\): RuntimeError"):
                    await once.start(FLAKY, "1 10", seed=1)  # reset 3: no retry left
            return out
        assert asyncio.run(scenario()).observation


def test_a_stalled_service_fails_each_call_within_its_deadline(tmp_path):
    port = free_port()
    with serving(env_args(port), port, tmp_path / "server.log") as (url, proc):
        async def scenario():
            async with HTTPEnvClient(url, timeout_s=0.5, retries=10, backoff_s=0.05,
                                     deadline_s=2.0) as client:
                session = (await client.start("guess")).session
                proc.send_signal(signal.SIGSTOP)
                try:
                    took = []
                    for call in (lambda: client.step(session, "guess 1"),
                                 lambda: client.end(session)):
                        began = time.monotonic()
                        with pytest.raises(EnvClientError) as info:
                            await call()
                        took.append((time.monotonic() - began, str(info.value)))
                finally:
                    proc.send_signal(signal.SIGCONT)
                # running again, it answers what was sent meanwhile: one of the /end attempts
                # ended the session (retrying /end is safe)
                with pytest.raises(EnvClientError, match="404"):
                    await client.end(session)
                return took
        (step_s, step_error), (end_s, end_error) = asyncio.run(scenario())
    assert step_s < 1.5 and "ReadTimeout" in step_error  # sent: not retried
    assert 1.9 < end_s < 3.0 and "deadline (2 s)" in end_error  # retried until the deadline


def test_a_crashed_service_is_retried_until_it_is_back(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    with (tmp_path / "first.log").open("w") as out:
        first = subprocess.Popen([*tiderl_command(), *env_args(port)], stdout=out,
                                 stderr=subprocess.STDOUT)
    second = None
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process_exit(first, tmp_path / "first.log"))

        async def scenario():
            nonlocal second
            async with HTTPEnvClient(f"http://127.0.0.1:{port}", retries=12, backoff_s=0.2,
                                     max_backoff_s=1.0, deadline_s=30.0) as client:
                await client.health()
                first.kill()
                first.wait()
                with pytest.raises(EnvClientError, match="ConnectError"):
                    async with HTTPEnvClient(f"http://127.0.0.1:{port}", retries=1,
                                             backoff_s=0.01) as impatient:
                        await impatient.step("s1", "guess 1")  # refused: retried once, fails
                with log.open("w") as out:
                    second = subprocess.Popen([*tiderl_command(), *env_args(port)], stdout=out,
                                              stderr=subprocess.STDOUT)
                return await client.start("guess")  # refused until the new one listens
        assert asyncio.run(scenario()).session == "s1"  # a new process: a new table
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                stop_process(proc)
