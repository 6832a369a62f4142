"""Engine clients: the Prometheus parser and metric mapping on recorded /metrics text, the
vLLM / SGLang request bodies and response parsing, and the clients' HTTP calls against
httpx.MockTransport (a fake at the true external edge: a vLLM or SGLang server)."""

import asyncio
import base64
import json
import os

import httpx
import pytest

from tests.unit.test_engine_images import png
from tiderl.core.types import ImageRef
from tiderl.engine.client_metrics import ClientMetrics, metrics_from_prometheus, vllm_kv_capacity
from tiderl.engine.clients import (
    EmbeddedClient,
    EngineRequestError,
    NotSupported,
    SGLangClient,
    VLLMClient,
    completion_body,
    parse_completion,
    parse_sglang_generate,
    sglang_generate_body,
)
from tiderl.engine.metric_names import FRACTIONS, SGLANG_NAMINGS, TIDERL_NAMINGS, VLLM_NAMINGS
from tiderl.engine.prometheus import info_labels, parse_prometheus
from tiderl.engine.request import SamplingParams

MODEL = "Qwen/Qwen2.5-1.5B-Instruct"

# Recorded shape of a vLLM (v1 engine, data parallel 2) /metrics page, trimmed.
VLLM_METRICS = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0
vllm:num_requests_running{{engine="1",model_name="{MODEL}"}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.5
vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} 12288.0
vllm:prefix_cache_queries_total{{engine="1",model_name="{MODEL}"}} 4096.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} 9216.0
vllm:prefix_cache_hits_total{{engine="1",model_name="{MODEL}"}} 1024.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} 4.0
vllm:num_preemptions_total{{engine="1",model_name="{MODEL}"}} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}} 16384.0
vllm:prompt_tokens_created{{engine="0",model_name="{MODEL}"}} 1.7649e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{MODEL}"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 12.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 12.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{MODEL}"}} 1.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
num_gpu_blocks="27404"}} 1.0
"""

# An older vLLM (0.8-0.10) named the same gauges and counters with a "gpu_" prefix.
VLLM_OLD_METRICS = f"""\
vllm:gpu_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.125
vllm:gpu_prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} 800.0
vllm:gpu_prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} 200.0
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 1.0
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0
"""

# Recorded shape of an SGLang --enable-metrics /metrics page (tensor parallel 2), trimmed.
SGLANG_METRICS = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="{MODEL}",tp_rank="0"}} 28.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{{model_name="{MODEL}",tp_rank="0"}} 123859.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{model_name="{MODEL}",tp_rank="0"}} 0.28
sglang:token_usage{{model_name="{MODEL}",tp_rank="1"}} 0.30
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{{model_name="{MODEL}",tp_rank="0"}} 355.37
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="{MODEL}",tp_rank="0"}} 4.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{model_name="{MODEL}",tp_rank="0"}} 0.75
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{model_name="{MODEL}",tp_rank="0"}} 8.128902e+06
"""


def test_parser_sums_label_sets_and_drops_total_and_created():
    values = parse_prometheus(VLLM_METRICS)
    assert values["vllm:prefix_cache_queries"] == 16384.0
    assert values["vllm:prefix_cache_hits"] == 10240.0
    assert values["vllm:num_preemptions"] == 4.0
    assert values["vllm:num_requests_running"] == 5.0
    assert values["vllm:prompt_tokens"] == 16384.0
    assert "vllm:prompt_tokens_created" not in values
    assert values["vllm:time_to_first_token_seconds_count"] == 12.0
    assert values["vllm:cache_config_info"] == 1.0
    assert values["vllm:kv_cache_usage_perc"] == 0.75  # summed without `average`
    assert parse_prometheus(VLLM_METRICS, FRACTIONS)["vllm:kv_cache_usage_perc"] == 0.375


def test_parser_edge_cases():
    text = ('a{path="/x} y",le="+Inf"} 2 1700000000000\n'  # brace and space inside a label
            "a 3\n"
            'b{x="1"} NaN\n'
            'b{x="2"} 4\n'
            "c +Inf\n"
            "d NaN\n"
            "   \n# comment only\n")
    values = parse_prometheus(text)
    assert values["a"] == 5.0 and values["c"] == float("inf")
    assert values["b"] == 4.0  # a NaN label set is skipped
    assert values["d"] != values["d"]  # NaN: present, value unknown
    assert parse_prometheus("") == {}


@pytest.mark.parametrize("line", ["broken", 'd{x="1"} not-a-number', 'e{x="1} 2'])
def test_a_page_the_parser_refuses_is_an_error(line):
    with pytest.raises(ValueError, match="not Prometheus text"):
        parse_prometheus(f"a 1\n{line}\n")


def test_info_gauge_labels_and_counters_read_as_before():
    """vLLM's ``cache_config_info`` carries its values in labels; a counter is read under its
    name without ``_total`` whether the page's ``# TYPE`` line names it with or without."""
    labels = info_labels(VLLM_METRICS, "vllm:cache_config_info")
    assert labels == [{"block_size": "16", "cache_dtype": "auto",
                       "enable_prefix_caching": "True", "num_gpu_blocks": "27404"}]
    assert vllm_kv_capacity(VLLM_METRICS) == 27404 * 16
    assert vllm_kv_capacity(VLLM_OLD_METRICS) is None
    typed_bare = ("# TYPE vllm:prefix_cache_hits counter\n"
                  'vllm:prefix_cache_hits_total{engine="0"} 7.0\n')
    assert parse_prometheus(typed_bare) == {"vllm:prefix_cache_hits": 7.0}
    untyped = 'vllm:prefix_cache_hits_total{engine="0"} 7.0\n'
    assert parse_prometheus(untyped) == {"vllm:prefix_cache_hits": 7.0}


def test_vllm_metric_mapping():
    metrics = metrics_from_prometheus(parse_prometheus(VLLM_METRICS, FRACTIONS), VLLM_NAMINGS)
    assert metrics == ClientMetrics(prefix_cache_queries=16384.0, prefix_cache_hits=10240.0,
                                    kv_cache_usage_perc=0.375, num_requests_running=5.0,
                                    num_requests_waiting=1.0, num_preemptions=4.0,
                                    cache_hit_rate=0.625)
    old = metrics_from_prometheus(parse_prometheus(VLLM_OLD_METRICS, FRACTIONS), VLLM_NAMINGS)
    assert (old.prefix_cache_queries, old.prefix_cache_hits) == (800.0, 200.0)
    assert old.kv_cache_usage_perc == 0.125 and old.cache_hit_rate == 0.25
    assert old.num_preemptions is None


def test_sglang_metric_mapping():
    metrics = metrics_from_prometheus(parse_prometheus(SGLANG_METRICS, FRACTIONS), SGLANG_NAMINGS)
    assert metrics.prefix_cache_queries is None and metrics.prefix_cache_hits is None
    assert metrics.kv_cache_usage_perc == pytest.approx(0.29)  # mean over tp ranks
    assert (metrics.num_requests_running, metrics.num_requests_waiting) == (28.0, 4.0)
    assert metrics.cache_hit_rate == 0.75 and metrics.num_preemptions is None


def test_request_bodies():
    sampling = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=3,
                              stop_token_ids=(2,))
    assert completion_body([5, 6], sampling) == {
        "prompt": [5, 6], "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "logprobs": 1,
        "seed": 3, "stop_token_ids": [2]}
    assert completion_body([5], SamplingParams(max_tokens=1)) == {
        "prompt": [5], "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "logprobs": 1}
    assert sglang_generate_body([5, 6], sampling) == {
        "input_ids": [5, 6], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                            "sampling_seed": 3, "stop_token_ids": [2]}}


def test_sglang_body_sends_each_image_as_a_data_url_in_the_order_of_its_run():
    later, first = ImageRef("b", 20, 4, (1, 4, 4)), ImageRef("a", 2, 6, (1, 4, 6))
    png_a, png_b = png(8, 8, seed=1), png(8, 8, seed=2)
    body = sglang_generate_body(list(range(30)), SamplingParams(max_tokens=2),
                                [(later, png_b), (first, png_a)])
    prefix = "data:image/png;base64,"
    assert body["image_data"] == [prefix + base64.b64encode(png_a).decode(),
                                  prefix + base64.b64encode(png_b).decode()]
    assert "image_data" not in sglang_generate_body([1], SamplingParams(max_tokens=2))


VLLM_RESPONSE = {
    "id": "cmpl-8d1f", "object": "text_completion", "created": 1764900000, "model": MODEL,
    "choices": [{"index": 0, "text": " Paris.", "finish_reason": "length", "stop_reason": None,
                 "prompt_token_ids": [785, 6722, 315, 9625, 374], "token_ids": [12095, 13],
                 "logprobs": {"text_offset": [0, 6], "token_logprobs": [-0.25, -1.5],
                              "tokens": [" Paris", "."],
                              "top_logprobs": [{" Paris": -0.25}, {".": -1.5}]}}],
    "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2,
              "prompt_tokens_details": {"cached_tokens": 0}},
}

SGLANG_RESPONSE = {
    "text": " Paris.", "output_ids": [12095, 13],
    "meta_info": {"id": "a1b2", "finish_reason": {"type": "stop", "matched": 151645},
                  "prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 4,
                  "weight_version": "default", "e2e_latency": 0.05,
                  "output_token_logprobs": [[-0.25, 12095, None], [-1.5, 13, None]]},
}


def test_parse_vllm_completion_both_token_id_forms():
    out = parse_completion("t", VLLM_RESPONSE)
    assert (out.output_ids, out.logprobs, out.finish_reason) == ([12095, 13], [-0.25, -1.5],
                                                                 "length")
    assert (out.num_prompt_tokens, out.num_cached_tokens, out.version) == (5, 0, None)
    choice = dict(VLLM_RESPONSE["choices"][0], token_ids=None)
    choice["logprobs"] = dict(choice["logprobs"], tokens=["token_id:12095", "token_id:13"])
    old = parse_completion("t", dict(VLLM_RESPONSE, choices=[choice], usage={}))
    assert old.output_ids == [12095, 13] and old.num_cached_tokens == 0
    choice["logprobs"] = dict(choice["logprobs"], tokens=[" Paris", "."])
    with pytest.raises(ValueError, match="return_token_ids"):
        parse_completion("t", dict(VLLM_RESPONSE, choices=[choice]))


def test_parse_sglang_generate():
    out = parse_sglang_generate("t", [1, 2, 3, 4, 5], SGLANG_RESPONSE)
    assert (out.output_ids, out.logprobs, out.finish_reason) == ([12095, 13], [-0.25, -1.5],
                                                                 "stop")
    assert (out.num_prompt_tokens, out.num_cached_tokens, out.version) == (5, 4, None)
    no_ids = dict(SGLANG_RESPONSE, meta_info=dict(SGLANG_RESPONSE["meta_info"],
                                                  weight_version="3"))
    del no_ids["output_ids"]
    again = parse_sglang_generate("t", [1], no_ids)
    assert again.output_ids == [12095, 13] and again.version == 3


def mock_http(routes, seen):
    """A fake vLLM/SGLang server: {(method, path): (status, body)}; records request bodies."""
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path,
                     json.loads(request.content) if request.content else None))
        status, body = routes[(request.method, request.url.path)]
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)
    return httpx.AsyncClient(base_url="http://engine", transport=httpx.MockTransport(handler))


def test_vllm_client_calls():
    seen = []
    routes = {("POST", "/v1/completions"): (200, VLLM_RESPONSE),
              ("GET", "/metrics"): (200, VLLM_METRICS),
              ("POST", "/reset_prefix_cache"): (200, {})}

    async def scenario():
        async with VLLMClient("http://engine", MODEL, http=mock_http(routes, seen)) as client:
            out = await client.generate("t", [785, 6722], SamplingParams(max_tokens=2))
            metrics = await client.metrics()
            await client.flush()
            for call in (lambda: client.pin("t"), lambda: client.unpin("t"),
                         client.token_usage):
                with pytest.raises(NotSupported, match="VLLMClient"):
                    await call()
            with pytest.raises(NotSupported, match="folder"):
                await client.update_weights({}, 1)
            return out, metrics

    out, metrics = asyncio.run(scenario())
    assert out.output_ids == [12095, 13] and metrics.cache_hit_rate == 0.625
    assert metrics.kv_capacity_tokens == 27404 * 16  # vllm:cache_config_info's labels
    assert seen[0][2] == {"prompt": [785, 6722], "max_tokens": 2, "temperature": 1.0,
                          "top_p": 1.0, "logprobs": 1, "model": MODEL, "return_token_ids": True,
                          "return_weight_versions": True}
    assert [s[:2] for s in seen] == [("POST", "/v1/completions"), ("GET", "/metrics"),
                                     ("POST", "/reset_prefix_cache")]


def test_sglang_client_calls_and_errors():
    seen = []
    routes = {("POST", "/generate"): (200, SGLANG_RESPONSE),
              ("POST", "/update_weights_from_disk"): (200, {"success": True, "message": "ok"}),
              ("POST", "/flush_cache"): (200, {}),
              ("GET", "/metrics"): (404, "Not Found")}

    async def scenario():
        async with SGLangClient("http://engine", http=mock_http(routes, seen)) as client:
            out = await client.generate("t", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2))
            await client.update_weights("/ckpt/step7", 7)
            await client.flush()
            with pytest.raises(EngineRequestError, match="404: Not Found"):
                await client.metrics()
            with pytest.raises(NotSupported, match="folder"):
                await client.update_weights({}, 8)
            return out

    assert asyncio.run(scenario()).num_cached_tokens == 4
    assert seen[1][2] == {"model_path": "/ckpt/step7", "weight_version": "7",
                          "flush_cache": True}
    routes[("POST", "/update_weights_from_disk")] = (200, {"success": False, "message": "bad"})

    async def failing():
        async with SGLangClient("http://engine", http=mock_http(routes, seen)) as client:
            await client.update_weights("/ckpt/x", 9)

    with pytest.raises(RuntimeError, match="bad"):
        asyncio.run(failing())


def test_sglang_priority_levels_are_left_out_of_the_totals():
    """Under priority scheduling SGLang exports a count once as the total (priority="") and
    again per level; summing every label set would count each request twice."""
    page = (f'sglang:num_running_reqs{{model_name="{MODEL}",priority=""}} 5.0\n'
            f'sglang:num_running_reqs{{model_name="{MODEL}",priority="-1"}} 2.0\n'
            f'sglang:num_running_reqs{{model_name="{MODEL}",priority="0"}} 3.0\n'
            f'sglang:num_queue_reqs{{model_name="{MODEL}",priority=""}} 4.0\n'
            f'sglang:num_queue_reqs{{model_name="{MODEL}",priority="0"}} 4.0\n'
            f'sglang:max_total_num_tokens{{model_name="{MODEL}"}} 65536.0\n')

    async def scenario():
        routes = {("GET", "/metrics"): (200, page)}
        async with SGLangClient("http://engine", http=mock_http(routes, [])) as client:
            return await client.metrics()

    m = asyncio.run(scenario())
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_capacity_tokens) == (
        5.0, 4.0, 65536.0)


def test_embedded_client_runs_the_in_process_engine():
    from tiderl.engine.config import EngineConfig
    from tiderl.engine.llm_engine import LLMEngine
    from tiderl.models.config import ModelConfig

    engine = LLMEngine.from_configs(ModelConfig(), EngineConfig(kv_cache_tokens=1024))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)

    async def scenario():
        async with EmbeddedClient(engine) as client:
            first = await client.generate("t", list(range(5, 25)), greedy)
            again = await client.generate("t", list(range(5, 25)) + first.output_ids, greedy)
            pinned = await client.pin("t")
            usage = await client.token_usage()
            await client.unpin("t")
            state = {k: v * 0 for k, v in engine.model.state_dict().items()
                     if k == "lm_head.weight"}
            await client.update_weights(state, 2)
            await client.flush()
            return first, again, pinned, usage, await client.metrics()

    first, again, pinned, usage, metrics = asyncio.run(scenario())
    assert first.num_cached_tokens == 0 and len(first.output_ids) == 4
    assert again.num_cached_tokens == 16  # (20 + 4 - 1) // 16 blocks of the first turn
    assert pinned == usage.num_pinned_tokens == 16  # (24 + 4 - 1) // 16 after the second
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (44, 16)
    assert metrics.cache_hit_rate == pytest.approx(16 / 44) and engine.version == 2
    computed = engine.metrics()  # 20 prompt positions, then 8 (the rest was cached)
    assert computed.prompt_tokens_computed == 28 and computed.prefill_s > 0
    assert metrics.prefill_tokens_per_s == pytest.approx(28 / computed.prefill_s)


def test_prefill_rate_reads_from_our_servers_counters_and_not_before_they_count():
    page = ("tiderl:kv_cache_usage_perc 0.5\ntiderl:prompt_tokens_computed_total 300\n"
            "tiderl:prefill_seconds_total 0.25\n")
    values = parse_prometheus(page, FRACTIONS)
    assert metrics_from_prometheus(values, TIDERL_NAMINGS).prefill_tokens_per_s == 1200.0
    fresh = parse_prometheus("tiderl:kv_cache_usage_perc 0\n", FRACTIONS)
    assert metrics_from_prometheus(fresh, TIDERL_NAMINGS).prefill_tokens_per_s is None
    assert metrics_from_prometheus(values, VLLM_NAMINGS).prefill_tokens_per_s is None


@pytest.mark.gpu
def test_real_vllm_server_round_trip():
    """Tiny round trip against a running vLLM server: TIDERL_VLLM_URL and TIDERL_VLLM_MODEL."""
    url, model = os.environ.get("TIDERL_VLLM_URL"), os.environ.get("TIDERL_VLLM_MODEL")
    if not url or not model:
        pytest.skip("set TIDERL_VLLM_URL and TIDERL_VLLM_MODEL to a running vLLM server")

    async def scenario():
        async with VLLMClient(url, model) as client:
            out = await client.generate("t", [1, 2, 3, 4], SamplingParams(max_tokens=2))
            return out, await client.metrics()

    out, metrics = asyncio.run(scenario())
    assert len(out.output_ids) == len(out.logprobs) == 2
    assert metrics.prefix_cache_queries is not None and metrics.prefix_cache_queries >= 4


@pytest.mark.gpu
def test_real_sglang_server_round_trip():
    """Tiny round trip against a running SGLang server (--enable-metrics): TIDERL_SGLANG_URL."""
    url = os.environ.get("TIDERL_SGLANG_URL")
    if not url:
        pytest.skip("set TIDERL_SGLANG_URL to a running SGLang server")

    async def scenario():
        async with SGLangClient(url) as client:
            out = await client.generate("t", [1, 2, 3, 4], SamplingParams(max_tokens=2))
            return out, await client.metrics()

    out, metrics = asyncio.run(scenario())
    assert len(out.output_ids) == len(out.logprobs) == 2
    assert 0.0 <= metrics.kv_cache_usage_perc <= 1.0
