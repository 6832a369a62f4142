"""A real `tiderl engine serve` fired at from its first accepted connection, and again while it
sleeps and wakes: every completion is answered with ``choices`` or with a 503 that says why it
is not ready (``loading``, ``asleep``) in a one-line JSON error with ``Retry-After``, never
anything else."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.integration.serving import free_port, process_exit, stop_process, tiderl_command
from tests.waiting import wait_until
from tiderl.models.random_init import write_random_checkpoint

COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.0}
NUM_FIRING = 3  # clients firing at once
NUM_SERVED = 12  # completions each phase waits for


def is_completion(response: httpx.Response) -> bool:
    """A 200 whose JSON has the two token ids asked for in ``choices``."""
    try:
        token_ids = response.json()["choices"][0]["token_ids"]
    except (ValueError, KeyError, IndexError, TypeError):
        return False
    return response.status_code == 200 and len(token_ids) == 2


def not_ready_kind(response: httpx.Response) -> str | None:
    """The ``type`` of a 503 with ``Retry-After`` and a one-line JSON error, else None."""
    if response.status_code != 503 or "retry-after" not in response.headers:
        return None
    if "\n" in response.text:
        return None
    try:
        return json.loads(response.text)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return None


def strays(answers: list[httpx.Response]) -> list[str]:
    """The answers that are neither a completion nor a 503 saying the engine is not ready."""
    return [f"{r.status_code} {r.text[:200]}" for r in answers
            if not is_completion(r) and not_ready_kind(r) not in ("loading", "asleep")]


@contextmanager
def firing(url: str) -> Iterator[list[httpx.Response]]:
    """NUM_FIRING clients posting completions back to back until the block ends (a refused
    connect is tried again at once: the server is not listening yet); yields the answers."""
    answers: list[httpx.Response] = []
    stop = threading.Event()

    def fire() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                try:
                    answers.append(http.post(f"{url}/v1/completions", json=COMPLETION))
                except httpx.ConnectError:
                    stop.wait(0.005)
    threads = [threading.Thread(target=fire, daemon=True) for _ in range(NUM_FIRING)]
    for thread in threads:
        thread.start()
    try:
        yield answers
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)


def served(answers: list[httpx.Response], since: int = 0) -> Callable[[], bool]:
    return lambda: sum(map(is_completion, answers[since:])) >= NUM_SERVED


@pytest.fixture
def engine_process(tmp_path):
    model = tmp_path / "m0"
    write_random_checkpoint("tiny", model, 0)
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*tiderl_command(), "engine", "serve", "--model", str(model),
                                 "--port", str(port), "--set", "engine.kv_cache_tokens=256"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", model, process_exit(proc, log)
    finally:
        stop_process(proc)


def test_every_completion_from_the_first_connection_is_choices_or_a_503(engine_process):
    url, _, gone = engine_process
    with firing(url) as answers:
        wait_until(served(answers), "completions served", gone=gone)
    assert strays(answers) == []


def test_a_sleeping_or_waking_engine_answers_503_asleep(engine_process):
    url, model, gone = engine_process
    with firing(url) as answers:
        wait_until(served(answers), "completions served", gone=gone)
    with httpx.Client(base_url=url, timeout=120) as http:
        assert http.post("/tiderl/sleep").status_code == 200
        asleep = http.post("/v1/completions", json=COMPLETION)
        with firing(url) as during:
            woken = http.post("/tiderl/wake_up", json={"path": str(model), "version": 1})
            awake_from = len(during)
            wait_until(served(during, awake_from), "completions served after the wake-up",
                       gone=gone)
    assert not_ready_kind(asleep) == "asleep", asleep.text
    assert woken.status_code == 200, woken.text
    assert strays(during) == []
