"""The vLLM and SGLang clients against FakeVLLMServer / FakeSGLangServer (real HTTP servers on
loopback with those engines' 0.34.0 / 0.5.23 routes; what they do on a GPU), and real jobs that roll
out on them through ``engine.urls``: on a Qwen2 folder, and on a Llama folder that only those
engines (here: transformers behind the vLLM fake) and the trainer's HFCausalLM run. What
FakeSGLangServer refuses, and how, is SGLang 0.5.23's (docs/engine.md, "SGLang routes")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.integration.fake_engines import (
    FakeSGLangServer,
    FakeVLLMServer,
    TransformersEngine,
    running,
)
from tests.tiny_llama import write_tiny_llama
from tests.waiting import wait_until
from tiderl.engine.clients import EngineRequestError, SGLangClient, VLLMClient, _error_message
from tiderl.engine.config import SERVED_MODEL_NAME
from tiderl.engine.request import SamplingParams
from tiderl.launch.job import run_local
from tiderl.models.folder import load_state_dict
from tiderl.models.random_init import write_random_checkpoint
from tiderl.profile import load_profile

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = list(range(40, 80))  # 40 tokens: a repeat hits 2 full blocks (32)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for seed in (0, 1):
        write_random_checkpoint("tiny", root / f"m{seed}", seed=seed)
    return root


def test_vllm_client_reloads_sleeps_wakes_and_tags_versions(models):
    fake = FakeVLLMServer(models / "m0")

    async def scenario(url: str):
        async with VLLMClient(url, SERVED_MODEL_NAME) as client:
            first = await client.generate("a", PROMPT, GREEDY, priority=-1)
            again = await client.generate("b", PROMPT, GREEDY)
            await client.update_weights(str(models / "m1"), 3)
            other = await client.generate("c", PROMPT, GREEDY)
            metrics = await client.metrics()
            await client.sleep()
            with pytest.raises(EngineRequestError, match="the engine is asleep"):
                await client.generate("d", PROMPT, GREEDY)
            await client.wake_up(str(models / "m0"), 4)
            back = await client.generate("e", PROMPT, GREEDY)
            return first, again, other, metrics, back

    with running(fake) as url:
        first, again, other, metrics, back = asyncio.run(scenario(url))
    assert first.version is None  # "default" until the first update names a version
    assert again.num_cached_tokens == 32 and again.output_ids == first.output_ids
    assert other.version == 3 and other.num_cached_tokens == 0  # the reload was flushed
    assert other.output_ids != first.output_ids
    assert back.version == 4 and back.output_ids == first.output_ids
    assert metrics.kv_capacity_tokens == 2048 and metrics.prefix_cache_hits == 32
    completions = [body for path, body in fake.calls if path == "/v1/completions"]
    assert completions[0]["priority"] == -1 and "priority" not in completions[1]
    assert completions[0]["return_token_ids"] and completions[0]["return_weight_versions"]
    update = ["/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache",
              "/resume"]
    assert fake.paths() == ["/v1/completions"] * 2 + update + [
        "/v1/completions", "/sleep", "/v1/completions", "/wake_up", *update, "/v1/completions"]
    assert dict(fake.calls)["/sleep"] == {"level": 2, "mode": "wait"}
    rpc = [body for path, body in fake.calls if path == "/collective_rpc"]
    assert rpc[0] == {"method": "reload_weights",
                      "kwargs": {"weights_path": str(models / "m1")}}


def test_vllm_keep_on_update_leaves_the_prefix_cache(models):
    fake = FakeVLLMServer(models / "m0")

    async def scenario(url: str):
        async with VLLMClient(url, SERVED_MODEL_NAME, flush_on_update=False) as client:
            await client.generate("a", PROMPT, GREEDY)
            await client.update_weights(str(models / "m1"), 1)
            return await client.generate("b", PROMPT, GREEDY)

    with running(fake) as url:
        assert asyncio.run(scenario(url)).num_cached_tokens == 32
    assert "/reset_prefix_cache" not in fake.paths()


def test_sglang_client_updates_from_disk_releases_and_resumes_memory(models):
    fake = FakeSGLangServer(models / "m0")

    async def scenario(url: str):
        async with SGLangClient(url) as client:
            first = await client.generate("a", PROMPT, GREEDY, priority=-1)
            await client.update_weights(str(models / "m1"), 2)
            other = await client.generate("b", PROMPT, GREEDY)
            metrics = await client.metrics()
            await client.sleep()
            await client.wake_up(str(models / "m0"), 5)
            back = await client.generate("c", PROMPT, GREEDY)
            seeded = SamplingParams(max_tokens=2, seed=7)
            return first, other, metrics, back, await client.generate("d", PROMPT, seeded)

    with running(fake) as url:
        first, other, metrics, back, seeded = asyncio.run(scenario(url))
    assert first.version is None and other.version == 2 and back.version == 5
    assert other.num_cached_tokens == 0 and other.output_ids != first.output_ids
    assert back.output_ids == first.output_ids and len(seeded.output_ids) == 2
    assert metrics.kv_capacity_tokens == 2048
    disk = [body for path, body in fake.calls if path == "/update_weights_from_disk"]
    assert disk == [{"model_path": str(models / "m1"), "weight_version": "2",
                     "flush_cache": True},
                    {"model_path": str(models / "m0"), "weight_version": "5",
                     "flush_cache": True}]
    generate = [body for path, body in fake.calls if path == "/generate"]
    assert generate[0]["priority"] == -1 and "priority" not in generate[1]
    assert generate[-1]["sampling_params"]["sampling_seed"] == 7  # not "seed": a 400 there
    assert fake.paths()[-4:-2] == ["/resume_memory_occupation", "/update_weights_from_disk"]


# -- FakeSGLangServer refuses what SGLang 0.5.23 refuses (docs/engine.md, "SGLang routes") ------

ERROR_RESPONSE = {"object": "error", "type": "Bad Request", "param": None, "code": 400}
UNKNOWN_SEED = (  # sglang/api/v1/api_types.py:1256 and :96-107, serde's text
    "unknown field `seed`, expected one of `max_new_tokens`, `stop`, `stop_token_ids`, "
    "`stop_regex`, `temperature`, `top_p`, `top_k`, `min_p`, `frequency_penalty`, "
    "`presence_penalty`, `repetition_penalty`, `min_new_tokens`, `n`, `json_schema`, `regex`, "
    "`ebnf`, `structural_tag`, `ignore_eos`, `skip_special_tokens`, "
    "`spaces_between_special_tokens`, `no_stop_trim`, `stream_interval`, `logit_bias`, "
    "`sampling_seed`, `custom_params`, `beam_width`, `watermark`, `choice`")


def test_the_sglang_fake_refuses_generate_bodies_as_sglang_does(models):
    """Each check in SGLang's order, with its body shape: the request type (a 400
    ErrorResponse), the JSON schema (``{"error": text}``), the engine (``{"error":
    {"message"}}``); TideRL's client reads the message out of each, on one line."""
    fake = FakeSGLangServer(models / "m0")
    n = fake.engine.max_model_len
    cases = [  # body, which check refuses it, its message (the request type's: a part of it)
        ({"input_ids": PROMPT, "sampling_params": {"seed": 7}}, "schema", UNKNOWN_SEED),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1.5}}, "schema",
         "invalid type: floating point `1.5`, expected i64"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "schema",
         'invalid type: string "hot", expected f64'),
        ({"input_ids": PROMPT, "priority": "3"}, "schema",
         'invalid type: string "3", expected i64'),
        ({"input_ids": PROMPT, "return_logprob": "yes"}, "schema",
         'invalid type: string "yes", expected a value or an array of values for BoolOrList'),
        ({"input_ids": "abc"}, "type", "must be list or null; got str"),
        ({"input_ids": PROMPT, "priority": "high"}, "type", "valid integer"),
        ({"sampling_params": {}}, "engine",
         "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": []}, "engine", "input_ids cannot be empty."),
        ({"input_ids": [7] * n}, "engine",
         f"The input ({n} tokens) is longer than the model's context length ({n} tokens)."),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n}}, "engine",
         f"Requested token count exceeds the model's maximum context length of {n} tokens. "
         f"You requested a total of {n + len(PROMPT)} tokens: {len(PROMPT)} tokens from the "
         f"input messages and {n} tokens for the completion. Please reduce the number of "
         "tokens in the input messages or the completion to fit within the limit."),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "engine",
         "top_p must be in (0, 1], got 0."),
    ]
    with running(fake) as url, httpx.Client(base_url=url) as http:
        for body, check, message in cases:
            response = http.post("/generate", json=body)
            assert response.status_code == 400, body
            if check == "type":
                answer = response.json()
                assert {k: answer[k] for k in ERROR_RESPONSE} == ERROR_RESPONSE, body
                assert message in answer["message"] and message in _error_message(response)
            else:
                expected = {"error": message if check == "schema" else {"message": message}}
                assert response.json() == expected, body
                assert _error_message(response) == message
        not_json = http.post("/generate", content=b"{",
                             headers={"content-type": "application/json"})
        no_body = http.post("/generate")
        # a key it does not know is ignored; after every refusal it serves on
        served = http.post("/generate", json={"input_ids": PROMPT, "not_a_field": 1,
                                              "sampling_params": {"max_new_tokens": 2}})
        wrong_method, no_route = http.get("/generate"), http.post("/generate_text", json={})
    assert not_json.status_code == no_body.status_code == 400
    assert not_json.json()["object"] == no_body.json()["object"] == "error"
    assert "Field required" in no_body.json()["message"]
    assert served.status_code == 200 and len(served.json()["output_ids"]) == 2
    assert served.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert (wrong_method.status_code, wrong_method.json()) == (405,
                                                                {"detail": "Method Not Allowed"})
    assert (no_route.status_code, no_route.json()) == (404, {"detail": "Not Found"})


def test_the_sglang_fake_refuses_weight_memory_and_flush_bodies_as_sglang_does(models):
    fake = FakeSGLangServer(models / "m0")
    m1 = str(models / "m1")

    async def client_calls(url: str):
        async with SGLangClient(url) as client:
            await client.flush()  # its answer is text, not JSON
            with pytest.raises(EngineRequestError,
                               match="update_weights_from_disk: 400: Failed to get weights "
                                     "iterator: "):
                await client.update_weights(str(models / "nowhere"), 3)
            return await client.generate("a", PROMPT, GREEDY)

    with running(fake) as url, httpx.Client(base_url=url) as http:
        answers = {
            "no model_path": http.post("/update_weights_from_disk", json={}),
            "an int version": http.post("/update_weights_from_disk",
                                        json={"model_path": m1, "weight_version": 3}),
            "GET": http.get("/update_weights_from_disk"),
            "no body": http.post("/release_memory_occupation"),
            "tags not a list": http.post("/release_memory_occupation",
                                         json={"tags": "weights"}),
            "a negative timeout": http.post("/flush_cache", params={"timeout": -1}),
        }
        flushed = http.get("/flush_cache")
        after_failure = asyncio.run(client_calls(url))
        updated = http.post("/update_weights_from_disk",
                            json={"model_path": m1, "weight_version": "3", "not_a_field": 1})
        released = http.post("/release_memory_occupation", json={})
        resumed = http.post("/resume_memory_occupation", json={"rid": "r"})
    for what in ("no model_path", "an int version", "no body", "tags not a list",
                 "a negative timeout"):
        response = answers[what]
        assert response.status_code == 400, what
        assert {k: response.json()[k] for k in ERROR_RESPONSE} == ERROR_RESPONSE, what
    assert "model_path" in answers["no model_path"].json()["message"]
    assert "valid string" in answers["an int version"].json()["message"]
    assert answers["GET"].status_code == 405
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.\n")
    assert after_failure.version is None  # the failed update left version and weights alone
    assert updated.json() == {"success": True, "num_paused_requests": 0, "message":
                              "Succeeded to update model weights. Weight version updated "
                              "to 3."}
    assert (released.status_code, released.json()) == (200, None)
    assert (resumed.status_code, resumed.json()) == (200, None)


@contextlib.contextmanager
def held(fake: FakeSGLangServer) -> Iterator[None]:
    """Every generation on ``fake`` held in flight until ``let_go``, or the block ends."""
    fake.hold()
    try:
        yield
    finally:
        fake.let_go()


def in_thread(pool: ThreadPoolExecutor, url: str, call) -> Future:
    """``call(client)`` on its own SGLangClient in a pool thread, while the test goes on."""
    async def run():
        async with SGLangClient(url) as client:
            return await call(client)

    return pool.submit(asyncio.run, run())


def test_a_disk_update_on_the_sglang_fake_waits_for_the_generations_in_flight(models):
    """SGLang's model-update lock: the update waits for a generation in flight, and one sent
    while it waits runs after it, on the new weights."""
    fake = FakeSGLangServer(models / "m0")
    with running(fake) as url, ThreadPoolExecutor(3) as pool, held(fake):
        first = in_thread(pool, url, lambda c: c.generate("a", PROMPT, GREEDY))
        wait_until(lambda: fake.in_flight == 1, "a generation in flight")
        update = in_thread(pool, url, lambda c: c.update_weights(str(models / "m1"), 2))
        wait_until(lambda: fake.updates_waiting == 1, "the update waiting",
                   gone=lambda: "the update ended" if update.done() else None)
        second = in_thread(pool, url, lambda c: c.generate("b", PROMPT, GREEDY))
        wait_until(lambda: fake.paths().count("/generate") == 2, "the second generation sent")
        assert fake.weight_version == "default" and fake.in_flight == 1 and not update.done()
        fake.let_go()
        first, second = first.result(), second.result()
        update.result()
    assert first.version is None and second.version == 2
    assert second.output_ids != first.output_ids  # m1's weights


def test_a_busy_sglang_fake_refuses_a_flush_and_a_release_takes_it_down(models):
    """Requests in flight: ``/flush_cache`` answers 400; a memory release makes SGLang's
    scheduler assert, and the server exits (here: 500, then 503 to everything)."""
    fake = FakeSGLangServer(models / "m0")

    async def busy_calls(url: str):
        async with SGLangClient(url) as client:
            with pytest.raises(EngineRequestError, match=r"flush_cache: 400: Flush cache "
                                                         r"failed\.$"):
                await client.flush()
            with pytest.raises(RuntimeError, match="500: FakeSGLangServer exited as SGLang's "
                                                   "scheduler does: release_memory_occupation "
                                                   "should be called only when server is idle"):
                await client.sleep()
            return await client.is_up()

    with running(fake) as url, ThreadPoolExecutor(1) as pool, held(fake):
        generation = in_thread(pool, url, lambda c: c.generate("a", PROMPT, GREEDY))
        wait_until(lambda: fake.in_flight == 1, "a generation in flight")
        up = asyncio.run(busy_calls(url))
        fake.let_go()
        with pytest.raises(RuntimeError, match="503: FakeSGLangServer has exited"):
            generation.result()
    assert not up
    assert fake.paths() == ["/generate", "/flush_cache", "/release_memory_occupation"]


def test_a_resume_with_nothing_released_takes_the_sglang_fake_down(models):
    fake = FakeSGLangServer(models / "m0")

    async def scenario(url: str):
        async with SGLangClient(url) as client:
            with pytest.raises(RuntimeError, match=r"resume_memory_occupation: 500: .*"
                                                   r"KeyError: 'kv_cache'"):
                await client.wake_up(str(models / "m1"), 1)
            with pytest.raises(RuntimeError, match="generate: 503: FakeSGLangServer has "
                                                   "exited"):
                await client.generate("a", PROMPT, GREEDY)
            return await client.is_up()

    with running(fake) as url:
        assert not asyncio.run(scenario(url))


SMALL = [
    "runtime.num_ranks=3", "runtime.rollout_ranks=1", "job.group_size=4",
    "job.batch_min_groups=1", "job.batch_groups=1", "env.max_turns=4", "engine.max_new_tokens=8",
    "engine.kv_cache_tokens=2048", "env.step_latency.median_s=0.02", "runtime.heartbeat_s=0.5",
    "job.steps=2", "report.plots=false",
]


# the SGLang job plays agent tasks (the OpenAI-SDK calc agent, docs/agents.md) on its servers
AGENT_TASKS = ["env.envs=[calc-openai]", "env.tasks={}", "env.options={}",
               'env.agents={calc-openai: {entry: "tiderl.examples.calc_openai:run"}}']


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_job_rolls_out_on_attached_servers_of_each_backend(tmp_path, models, backend):
    """2 steps of system tiderl on one rollout and two actor ranks, each attached to its own
    fake server: the cold start wakes rank 2's (from the model folder) and puts it back to
    sleep (ERS may move it again later), every version reaches rank 0's server by disk. On
    SGLang the tasks are an agent's."""
    fakes = [(FakeVLLMServer if backend == "vllm" else FakeSGLangServer)(models / "m0")
             for _ in range(3)]
    tasks = AGENT_TASKS if backend == "sglang" else []
    with running(fakes[0]) as u0, running(fakes[1]) as u1, running(fakes[2]) as u2:
        profile = load_profile("local", [*SMALL, f"engine.backend={backend}",
                                         f"engine.urls=[{u0}, {u1}, {u2}]",
                                         f"model.path={models / 'm0'}", *tasks])
        result = run_local(profile, run_root=tmp_path)
    assert result.exit_code == 0
    metrics = [json.loads(line) for line in
               (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["trained_samples"] >= 4 and m["staleness_max"] <= 2 for m in metrics)
    # (max_staleness 1, and a straggler carried one version: job.carry_versions)
    sleep, wake = (("/sleep", "/wake_up") if backend == "vllm" else
                   ("/release_memory_occupation", "/resume_memory_occupation"))
    moves = [path for path in fakes[2].paths() if path in (sleep, wake)]
    assert moves[:3] == [sleep, wake, sleep]  # asleep at start, the cold start, back
    assert moves == [sleep, wake] * (len(moves) // 2) + [sleep] * (len(moves) % 2)
    assert sleep not in fakes[0].paths()  # the rollout rank's server never slept
    update = "/collective_rpc" if backend == "vllm" else "/update_weights_from_disk"
    loaded = [json.dumps(body) for path, body in fakes[0].calls if path == update]
    assert [int(re.search(r"weights/v(\d+)", b).group(1)) for b in loaded] == [1, 2]
    woken = [json.dumps(body) for path, body in fakes[2].calls if path == update]
    assert str(models / "m0") in woken[0]  # version 0: the model folder itself


def test_a_job_trains_another_architecture_rolling_out_on_vllm(tmp_path):
    """A tiny Llama folder (not Qwen2): fake vLLM servers generate with transformers, the
    actors train it through HFCausalLM with DDP, and every version reaches the rollout rank's
    server as a folder of the same architecture with the trained weights."""
    folder = write_tiny_llama(tmp_path / "llama")
    fakes = [FakeVLLMServer(folder) for _ in range(3)]
    with running(fakes[0]) as u0, running(fakes[1]) as u1, running(fakes[2]) as u2:
        profile = load_profile("local", [*SMALL, "engine.backend=vllm",
                                         f"engine.urls=[{u0}, {u1}, {u2}]",
                                         f"model.path={folder}", "trainer.backend=ddp"])
        result = run_local(profile, run_root=tmp_path / "runs")
    assert result.exit_code == 0
    metrics = [json.loads(line) for line in
               (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["trained_samples"] >= 4 for m in metrics)
    assert isinstance(fakes[0].engine, TransformersEngine)
    assert fakes[0].engine.decode_tokens > 0 and fakes[0].weight_version == "2"
    loaded = [body["kwargs"]["weights_path"] for path, body in fakes[0].calls
              if path == "/collective_rpc"]
    assert [int(Path(p).name.removeprefix("v")) for p in loaded] == [1, 2]
    config = json.loads((Path(loaded[-1]) / "config.json").read_text())
    assert config["model_type"] == "llama"
    before, after = load_state_dict(folder), load_state_dict(loaded[-1])
    assert set(after) == set(before)
    assert any(not torch.equal(after[name], before[name]) for name in before)
    assert after.keys() == fakes[0].engine.model.state_dict().keys()
    for name, tensor in fakes[0].engine.model.state_dict().items():
        assert torch.equal(tensor, after[name]), name  # the server serves the trained weights


def test_the_transformers_engine_serves_the_same_tokens_after_a_sleep_and_wake(tmp_path):
    """Its sleep frees every weight (the meta device) and its wake loads them again; the
    buffers no checkpoint holds (Llama's rotary frequencies) come back as they were."""
    folder = write_tiny_llama(tmp_path / "llama")
    engine = TransformersEngine(folder, kv_cache_tokens=2048)
    buffers = {name: b.clone() for name, b in engine.model.named_buffers()}
    assert buffers  # the rotary frequencies
    before = asyncio.run(engine.generate("a", PROMPT, GREEDY))
    engine.sleep()
    assert engine.model.model.embed_tokens.weight.is_meta
    engine.wake_up(load_state_dict(folder), 1)
    after = asyncio.run(engine.generate("b", PROMPT, GREEDY))
    for name, buffer in engine.model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs
