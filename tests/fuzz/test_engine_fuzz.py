"""A real `tiderl engine serve` (admin token set) under 1,000 seeded malformed requests and
bounded floods: every answer a 4xx with a one-line JSON error, none a 5xx, no connection lost,
and correct requests are served afterwards. A failure names its case; the seed reproduces it."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.fuzz.inputs import FuzzCounts, engine_cases, engine_flood, engine_serves, send_cases
from tests.integration.serving import free_port, serving
from tiderl.engine.clients import EngineRequestError, TideRLHTTPClient
from tiderl.engine.kv_cache_manager import PinRefused
from tiderl.engine.prometheus import parse_prometheus
from tiderl.engine.request import SamplingParams
from tiderl.models.vocab import VOCAB

SEED = 18
TOKEN = "fuzz-admin-token-18"
KV_TOKENS = 1024  # 64 blocks of 16, smaller than the 4,096-token context
CONTEXT = 4096
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-fuzz")
    port = free_port()
    args = ["engine", "serve", "--set", "model.size=tiny", "--port", str(port),
            "--set", f"engine.kv_cache_tokens={KV_TOKENS}"]
    with serving(args, port, root / "server.log", env={"TIDERL_ADMIN_TOKEN": TOKEN}) as (
            url, proc):
        yield {"url": url, "proc": proc, "log": root / "server.log"}


def assert_clean(counts: FuzzCounts, server) -> None:
    assert counts.is_clean, "\n".join(counts.failures[:10])
    assert server["proc"].poll() is None
    assert engine_serves(server["url"], TOKEN)
    assert "Traceback" not in server["log"].read_text()


def test_1000_malformed_requests_are_one_line_4xx_and_the_server_serves_on(server):
    rng = random.Random(SEED)
    cases = engine_cases(rng, 1000, vocab_size=len(VOCAB), max_model_len=CONTEXT, token=TOKEN)
    began = time.monotonic()
    counts = asyncio.run(send_cases(server["url"], cases))
    assert counts.sent == counts.status_4xx == len(cases) == 1001
    assert {"random_bytes", "wrong_type", "huge_value", "out_of_vocab", "enormous_prompt",
            "deep_nesting", "wrong_content_type", "wrong_route", "no_token",
            "admin_bad_body", "huge_body"} <= set(counts.by_kind)
    assert_clean(counts, server)
    assert time.monotonic() - began < 60


def test_a_flood_of_pins_is_bounded_and_leaves_room_for_requests(server):
    """400 pins of distinct tasks: one pinned task per KV block (64) at most, the rest 409."""
    counts = asyncio.run(send_cases(server["url"], engine_flood(400, TOKEN), concurrency=16))
    assert counts.sent == 400 and counts.status_2xx == 64 and counts.status_4xx == 336
    page = parse_prometheus(httpx.get(server["url"] + "/metrics", timeout=10).text)
    assert page["tiderl:num_tasks"] == 64  # bounded per-task state
    assert_clean(counts, server)

    async def forget_all():
        async with TideRLHTTPClient(server["url"], admin_token=TOKEN) as client:
            for i in range(400):
                await client.forget(f"flood-{i}")
    asyncio.run(forget_all())
    page = parse_prometheus(httpx.get(server["url"] + "/metrics", timeout=10).text)
    assert page["tiderl:num_tasks"] == 0


def test_pinned_long_contexts_never_wedge_the_server(server):
    """The measured fault: 4 pins held the pool and every later request queued until unpin."""
    async def scenario():
        async with TideRLHTTPClient(server["url"], timeout=60, admin_token=TOKEN) as client:
            pinned, refused = 0, 0
            for i in range(4):
                await client.generate(f"long{i}", [10 + i] * 230, GREEDY)
                try:
                    pinned += await client.pin(f"long{i}")
                except PinRefused:
                    refused += 1
            began = time.monotonic()
            out = await client.generate("after", [3] * 900, SamplingParams(8, 0.0))
            took = time.monotonic() - began
            for i in range(4):
                await client.forget(f"long{i}")
            await client.forget("after")
            return pinned, refused, out, took

    pinned, refused, out, took = asyncio.run(scenario())
    assert (pinned, refused) == (4 * 224, 0)  # (230 + 4 - 1) // 16 = 14 blocks each
    assert len(out.output_ids) == 8 and took < 30  # 908 tokens: pins released to fit it
    page = parse_prometheus(httpx.get(server["url"] + "/metrics", timeout=10).text)
    assert page["tiderl:pins_released"] == 4  # 64 - 14 = 50 blocks < 57 needed


def test_admin_routes_need_the_bearer_token_and_completions_do_not(server):
    url = server["url"]
    with httpx.Client(base_url=url, timeout=30) as http:
        for headers, word in (({}, "no"), ({"Authorization": "Bearer nope"}, "a wrong")):
            response = http.post("/tiderl/flush", headers=headers)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"] == {
                "message": f"{word} bearer token: send 'Authorization: Bearer TOKEN'",
                "type": "unauthorized"}
        assert http.get("/tiderl/usage").status_code == 401
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert http.post("/tiderl/flush", headers=good).json() == {"flushed": True}
        assert http.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code \
            == 200
        assert http.get("/health").status_code == http.get("/metrics").status_code == 200

    async def without_token():
        async with TideRLHTTPClient(url) as client:
            with pytest.raises(EngineRequestError, match="401: no bearer token"):
                await client.pin("t")
    asyncio.run(without_token())
