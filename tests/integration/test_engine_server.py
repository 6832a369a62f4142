"""The real `tiderl engine serve` process driven over HTTP with TideRLHTTPClient.

Prefix-cache arithmetic (block size 16): a finished turn of P prompt and O output tokens has
P + O - 1 tokens of KV (the last sampled token is never fed back), so its cached context is
(P + O - 1) // 16 full blocks; the next turn of the task hits exactly those blocks.
"""

import asyncio
import contextlib
import itertools
import json
import threading
import time

import httpx
import pytest

from tests.integration.serving import free_port, serving, wait_healthy
from tests.integration.test_cli import assert_one_line_error, tiderl
from tiderl.engine.clients import EngineRequestError, TideRLHTTPClient
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.prometheus import parse_prometheus
from tiderl.engine.request import SamplingParams
from tiderl.models.config import ModelConfig
from tiderl.models.loading import model_from_config
from tiderl.models.random_init import write_random_checkpoint
from tiderl.models.vocab import VOCAB

BLOCK = 16
KV_TOKENS = 4096
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    for seed in (0, 1):  # what `tiderl model init --seed N` writes (test_cli_model runs it)
        write_random_checkpoint("tiny", root / f"m{seed}", seed)
    port = free_port()
    args = ["engine", "serve", "--model", str(root / "m0"), "--port", str(port),
            "--set", f"engine.kv_cache_tokens={KV_TOKENS}"]
    with serving(args, port, root / "server.log") as (url, proc):
        yield {"url": url, "root": root, "proc": proc}


def run(server, scenario):
    async def main():
        async with TideRLHTTPClient(server["url"]) as client:
            return await scenario(client)
    return asyncio.run(main())


async def raw_metrics(client) -> dict[str, float]:
    return parse_prometheus((await client.http.get("/metrics")).text)


def delta(after: dict, before: dict, name: str) -> float:
    return after[f"tiderl:{name}"] - before[f"tiderl:{name}"]


async def conversation(client, task_id, first, turns, obs_len=5):
    """Turn k+1's prompt = turn k's prompt + its output + ``obs_len`` new observation ids."""
    prompt, results = list(first), []
    for k in range(turns):
        out = await client.generate(task_id, prompt, GREEDY)
        results.append((len(prompt), out))
        observation = [first[0] + 100 * (k + 1) + j for j in range(obs_len)]
        prompt = prompt + out.output_ids + observation
    return results


def test_multi_turn_conversation_hits_exact_prefix_blocks(server):
    async def scenario(client):
        before = await raw_metrics(client)
        results = await conversation(client, "chat", list(range(10, 31)), turns=4)
        return before, results, await raw_metrics(client), await client.metrics()

    before, results, after, metrics = run(server, scenario)
    assert all(out.finish_reason == "length" and len(out.output_ids) == 8 for _, out in results)
    prompts = [p for p, _ in results]
    assert prompts == [21, 34, 47, 60]  # 21, then + 8 outputs + 5 observation ids per turn
    cached = [out.num_cached_tokens for _, out in results]
    # (P + O - 1) // 16 blocks of the previous turn: (21+7)//16=1, (34+7)//16=2, (47+7)//16=3
    assert cached == [0, 16, 32, 48]
    for (p_prev, prev), (_, out) in itertools.pairwise(results):
        assert out.num_cached_tokens == (p_prev + len(prev.output_ids) - 1) // BLOCK * BLOCK
    assert [out.num_prompt_tokens for _, out in results] == prompts
    assert all(out.version == 0 and len(out.logprobs) == 8 for _, out in results)
    assert all(lp <= 0.0 for _, out in results for lp in out.logprobs)
    assert delta(after, before, "prefix_cache_queries") == 162  # 21 + 34 + 47 + 60
    assert delta(after, before, "prefix_cache_hits") == 96  # 0 + 16 + 32 + 48
    assert delta(after, before, "prompt_tokens_computed") == 162 - 96
    assert delta(after, before, "decode_tokens") == 32
    assert after["tiderl:num_requests_running"] == after["tiderl:num_requests_waiting"] == 0
    assert metrics.prefix_cache_hits == after["tiderl:prefix_cache_hits"]
    assert metrics.cache_hit_rate == pytest.approx(metrics.prefix_cache_hits
                                                   / metrics.prefix_cache_queries)


def test_pin_survives_flush_and_unpin_releases(server):
    async def scenario(client):
        a = await conversation(client, "pinned", list(range(400, 421)), turns=1)
        b = await conversation(client, "loose", list(range(600, 621)), turns=1)
        pinned = await client.pin("pinned")
        usage_pinned = await client.token_usage()
        await client.flush()
        after_flush = await client.token_usage()
        next_a = list(range(400, 421)) + a[0][1].output_ids + [7, 8, 9, 10, 11]
        next_b = list(range(600, 621)) + b[0][1].output_ids + [7, 8, 9, 10, 11]
        a2 = await client.generate("pinned", next_a, GREEDY)
        b2 = await client.generate("loose", next_b, GREEDY)
        usage_moved = await client.token_usage()
        await client.unpin("pinned")
        return pinned, usage_pinned, after_flush, a2, b2, usage_moved, await client.token_usage()

    pinned, usage_pinned, after_flush, a2, b2, usage_moved, released = run(server, scenario)
    assert pinned == 16  # (21 + 8 - 1) // 16 = 1 block of the task's context
    assert usage_pinned.num_total_tokens == KV_TOKENS
    assert usage_pinned.num_pinned_tokens == usage_pinned.num_used_tokens == 16
    assert after_flush.num_cached_tokens == 0 and after_flush.num_pinned_tokens == 16
    assert a2.num_cached_tokens == 16  # the pin kept its block through the flush
    assert b2.num_cached_tokens == 0  # the flush dropped the unpinned task's context
    assert usage_moved.num_pinned_tokens == 32  # the pin moved to the newest context: 34+7 // 16
    assert released.num_pinned_tokens == released.num_used_tokens == 0


BAD_BODIES = [
    ("malformed json", b"{not json", 422),
    ("prompt is text", {"prompt": "hello"}, 422),
    ("float token", {"prompt": [1.5]}, 422),
    ("empty prompt", {"prompt": []}, 400),
    ("id >= vocab", {"prompt": [1, len(VOCAB)]}, 400),
    ("negative id", {"prompt": [-1]}, 400),
    ("longer than context", {"prompt": [5] * 4097}, 400),
    ("max_tokens 0", {"prompt": [5], "max_tokens": 0}, 400),
    ("temperature text", {"prompt": [5], "temperature": "hot"}, 422),
    ("top_p > 1", {"prompt": [5], "top_p": 2.0}, 400),
    ("stop id outside vocab", {"prompt": [5], "stop_token_ids": [99999]}, 400),
    ("body is a list", [1, 2, 3], 422),
    ("temperature NaN", b'{"prompt": [5], "temperature": NaN}', 422),
    ("streaming", {"prompt": [5], "stream": True}, 400),
    ("two choices", {"prompt": [5], "n": 2}, 400),
]


def test_bad_input_is_a_json_error_and_the_server_keeps_serving(server):
    vocab = json.loads((server["root"] / "m0" / "config.json").read_text())["vocab_size"]
    assert vocab == len(VOCAB)  # BAD_BODIES' out-of-vocabulary id is the first one past the end
    url = server["url"]
    cases = [("/v1/completions", *case) for case in BAD_BODIES] + [
        ("/tiderl/pin", "pin without task", {}, 422),
        ("/tiderl/unpin", "unpin task not text", {"task_id": 5}, 422),
        ("/tiderl/update_weights", "no such folder", {"path": "/no/such", "version": 1}, 400),
        ("/tiderl/update_weights", "version missing", {"path": "/tmp"}, 422),
    ]
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, name, body, status in cases:
            if isinstance(body, bytes):
                response = http.post(path, content=body,
                                     headers={"content-type": "application/json"})
            else:
                response = http.post(path, json=body)
            assert response.status_code == status, (name, response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", name
            assert http.get("/health").status_code == 200, name
        assert "longer than the context" in http.post(
            "/v1/completions", json={"prompt": [5] * 4097}).json()["error"]["message"]
    assert server["proc"].poll() is None

    async def scenario(client):
        with pytest.raises(EngineRequestError, match="empty"):
            await client.generate("t", [], GREEDY)
        return await client.generate("t", [1, 2, 3], GREEDY)

    assert len(run(server, scenario).output_ids) == 8


def test_generation_never_runs_past_the_context(server):
    """As vLLM: max_tokens is cut to the context left after the prompt; a prompt that fills
    the context is refused."""
    prompt = [7] * 4090
    with httpx.Client(base_url=server["url"], timeout=120) as http:
        out = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 100,
                                                 "temperature": 0.0}).json()
        full = http.post("/v1/completions", json={"prompt": [7] * 4096, "max_tokens": 1})
    assert len(out["choices"][0]["token_ids"]) == 6 and out["choices"][0]["finish_reason"] \
        == "length"
    assert out["usage"]["total_tokens"] == 4096  # the tiny model's max_position_embeddings
    assert full.status_code == 400 and "fill the context" in full.json()["error"]["message"]


def test_update_weights_changes_outputs_and_resets_the_prefix_cache(server):
    m0, m1 = str(server["root"] / "m0"), str(server["root"] / "m1")
    prompt = list(range(800, 840))

    async def scenario(client):
        first = await client.generate("w0", prompt, GREEDY)
        again = await client.generate("w1", prompt, GREEDY)
        await client.update_weights(m1, 7)
        health = (await client.http.get("/health")).json()
        other = await client.generate("w2", prompt, GREEDY)
        with pytest.raises(EngineRequestError, match=r"no model\.safetensors"):
            await client.update_weights(str(server["root"]), 8)
        await client.update_weights(m0, 9)
        back = await client.generate("w3", prompt, GREEDY)
        return first, again, health, other, back, await raw_metrics(client)

    first, again, health, other, back, metrics = run(server, scenario)
    assert again.num_cached_tokens == 32 and again.output_ids == first.output_ids
    assert health["version"] == 7 and other.version == 7
    assert other.num_cached_tokens == 0  # KV of the old weights is never hit again
    assert (other.output_ids, other.logprobs) != (first.output_ids, first.logprobs)
    assert other.output_ids != first.output_ids
    assert back.version == 9 and back.num_cached_tokens == 0
    assert back.output_ids == first.output_ids
    assert back.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    assert metrics["tiderl:weight_version"] == 9


def test_a_huge_value_is_an_error_under_the_bound_naming_the_field(server):
    with httpx.Client(base_url=server["url"], timeout=60) as http:
        big = "x" * 7_000_000  # under the 8 MiB body limit
        response = http.post("/tiderl/update_weights", json={"path": big, "version": 1})
        assert response.status_code == 400, response.text[:2000]
        message = response.json()["error"]["message"]
        assert len(message) < 1000 and message.startswith("path xxx"), message[:2000]
        assert "… (7,000,000 characters)" in message
        response = http.post("/v1/completions", json={"prompt": [1], "model": "x" * 10_000_000})
        assert response.status_code == 413
        assert response.json()["error"]["message"] == "request body over 8388608 bytes"
        assert http.get("/health").status_code == 200


def test_serve_without_a_model_folder_is_one_line_exit_2(tmp_path):
    line = assert_one_line_error(tiderl("engine", "serve", "--model", str(tmp_path / "none")), 2)
    assert line == f"error: tiderl engine serve: --model {tmp_path / 'none'}: no such folder"
    line = assert_one_line_error(tiderl("engine", "serve", "--model", str(tmp_path)), 2)
    assert "config.json: not found" in line
    line = assert_one_line_error(tiderl("engine", "serve", "--set", "engine.kernels=fast"), 2)
    assert line == "error: --set: engine.kernels: expected one of auto, native, torch, got 'fast'"
    line = assert_one_line_error(tiderl("engine", "serve", "--set",
                                        f"model.path={tmp_path / 'none'}"), 2)
    assert line == f"error: tiderl engine serve: model.path {tmp_path / 'none'}: no such folder"


def test_concurrent_tasks_share_the_engine(server):
    async def scenario(client):
        prompts = [list(range(1000 + 30 * i, 1020 + 30 * i)) for i in range(6)]
        outs = await asyncio.gather(*(client.generate(f"c{i}", p, GREEDY)
                                      for i, p in enumerate(prompts)))
        return outs, await client.metrics()

    outs, metrics = run(server, scenario)
    assert [len(o.output_ids) for o in outs] == [8] * 6
    assert [o.task_id for o in outs] == [f"c{i}" for i in range(6)]
    assert metrics.num_requests_running == metrics.num_requests_waiting == 0


def test_sleep_frees_the_engine_and_wake_up_serves_the_folder_it_is_given(server):
    """What a rank moving to the trainer and back does to its server: asleep it answers a
    completion 503 (not ready, retry) and holds no KV; waking takes a weights folder and a
    version."""
    m0, m1 = str(server["root"] / "m0"), str(server["root"] / "m1")
    prompt = list(range(1200, 1230))

    async def scenario(client):
        first = await client.generate("s0", prompt, GREEDY)
        await client.pin("s0")
        await client.sleep()
        health = (await client.http.get("/health")).json()
        usage = await client.token_usage()
        refused = await client.http.post("/v1/completions", json={"prompt": prompt})
        with pytest.raises(EngineRequestError, match=r"no model\.safetensors"):
            await client.wake_up(str(server["root"]), 4)
        await client.wake_up(m1, 4)
        other = await client.generate("s2", prompt, GREEDY)
        await client.sleep()
        await client.wake_up(m0, 5)  # the module's other tests expect m0's weights
        back = await client.generate("s3", prompt, GREEDY)
        return (first, health, usage, refused, other, back,
                (await client.http.get("/health")).json())

    first, health, usage, refused, other, back, awake = run(server, scenario)
    assert health["asleep"] is True and usage.num_used_tokens == usage.num_pinned_tokens == 0
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
    assert refused.json()["error"]["type"] == "asleep"
    assert other.version == 4 and other.num_cached_tokens == 0
    assert other.output_ids != first.output_ids
    assert back.version == 5 and back.output_ids == first.output_ids
    assert awake == {"status": "ok", "version": 5, "asleep": False}


def _loading_server(load):
    """A LoadingServer on a free port, run in a thread: (url, server, thread, gone), where
    gone() says the thread ended (for wait_healthy)."""
    from tiderl.engine.loading_server import LoadingServer

    server = LoadingServer(load, port=free_port())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def gone():
        return None if thread.is_alive() else "the server's thread ended"
    return f"http://127.0.0.1:{server.config.port}", server, thread, gone


def test_health_answers_loading_until_the_engine_is_built_then_ok():
    """The socket is open before the engine exists: /health is 503 "loading" (so 200 still
    means ready to generate), every other route 503; then the engine's routes serve."""
    release = threading.Event()

    def load():
        release.wait(60)
        model, tokenizer = model_from_config(ModelConfig(size="tiny"))
        return LLMEngine(model, EngineConfig(kv_cache_tokens=256), model.config.eos_token_id), \
            tokenizer

    url, server, thread, gone = _loading_server(load)
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            while (loading := _answer(http, "/health")) is None:  # until it listens
                assert gone() is None
                time.sleep(0.05)
            completion = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
            metrics = http.get("/metrics")
            release.set()
            wait_healthy(url, gone)
            ready = http.get("/health").json()
            out = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}).json()
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
    assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
    assert completion.status_code == metrics.status_code == 503
    assert completion.json()["error"]["type"] == "loading"
    assert ready == {"status": "ok", "version": 0, "asleep": False}
    assert len(out["choices"][0]["token_ids"]) == 2
    assert not thread.is_alive() and server.failure is None


def _answer(http: httpx.Client, path: str) -> httpx.Response | None:
    with contextlib.suppress(httpx.HTTPError):
        return http.get(path)
    return None


def test_a_load_that_fails_stops_the_server_and_is_raised():
    from tiderl.engine.loading_server import serve_loading

    def load():
        raise RuntimeError("no such weights")

    url, server, thread, _ = _loading_server(load)
    thread.join(60)
    assert not thread.is_alive() and isinstance(server.failure, RuntimeError)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
    with pytest.raises(RuntimeError, match="no such weights"):
        serve_loading(load, port=free_port())
