"""The vLLM and SGLang clients against FakeVLLMServer / FakeSGLangServer (real HTTP servers on
loopback with those engines' 0.34.0 / 0.5.23 routes; what they do on a GPU), and real jobs that roll
out on them through ``engine.urls``: on a Qwen2 folder, and on a Llama folder that only those
engines (here: transformers behind the vLLM fake) and the trainer's HFCausalLM run."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch

from tests.integration.fake_engines import (
    FakeSGLangServer,
    FakeVLLMServer,
    TransformersEngine,
    running,
)
from tests.tiny_llama import write_tiny_llama
from tiderl.engine.clients import EngineRequestError, SGLangClient, VLLMClient
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
