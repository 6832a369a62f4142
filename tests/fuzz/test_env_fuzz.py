"""A real `tiderl env serve` (token set) under 1,000 seeded malformed requests and bounded
floods: every answer a 4xx with a one-line JSON error, none a 5xx, no connection lost, no
lock-out, and a correct episode afterwards. A failure names its case; the seed reproduces it."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.fuzz.inputs import FuzzCounts, env_cases, env_flood, env_serves, send_cases
from tests.integration.serving import env_serving
from tiderl.engine.prometheus import parse_prometheus

SEED = 18
TOKEN = "fuzz-env-token-18"
MAX_SESSIONS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with env_serving(tmp_path_factory.mktemp("env-fuzz"), "guess,shop", "--max-sessions",
                     str(MAX_SESSIONS), "--idle-ttl", "600",
                     env={"TIDERL_ENV_TOKEN": TOKEN}) as served:
        yield served


def metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)


def assert_clean(counts: FuzzCounts, server) -> None:
    assert counts.is_clean, "\n".join(counts.failures[:10])
    assert server["proc"].poll() is None
    assert env_serves(server["url"], TOKEN)
    assert "Traceback" not in server["log"].read_text()


def test_1000_malformed_requests_are_one_line_4xx_and_the_server_serves_on(server):
    rng = random.Random(SEED)
    cases = env_cases(rng, 1000, token=TOKEN)
    began = time.monotonic()
    counts = asyncio.run(send_cases(server["url"], cases))
    assert counts.sent == counts.status_4xx == len(cases) == 1001
    assert {"random_bytes", "wrong_type", "huge_value", "unknown_name", "deep_nesting",
            "wrong_content_type", "wrong_route", "no_token", "huge_body"} <= set(counts.by_kind)
    assert_clean(counts, server)
    assert time.monotonic() - began < 60


def test_an_unauthenticated_flood_of_starts_is_refused_and_locks_nobody_out(server):
    """The measured fault: 256 /start calls without a token filled the table for ~10 min."""
    before = metrics(server["url"])["tiderl_env_sessions_open"]
    counts = asyncio.run(send_cases(server["url"], env_flood(300, None), concurrency=16))
    assert counts.sent == counts.status_4xx == 300  # every one 401
    assert metrics(server["url"])["tiderl_env_sessions_open"] == before
    assert_clean(counts, server)


def test_an_authenticated_flood_evicts_idle_sessions_instead_of_locking_out(server):
    counts = asyncio.run(send_cases(server["url"], env_flood(300, TOKEN), concurrency=16))
    assert counts.sent == counts.status_2xx == 300  # no 429: the table made room each time
    page = metrics(server["url"])
    assert page["tiderl_env_sessions_open"] == MAX_SESSIONS
    assert page["tiderl_env_sessions_evicted"] >= 300 - MAX_SESSIONS
    assert page["tiderl_env_sessions_rejected"] == 0
    assert_clean(counts, server)
