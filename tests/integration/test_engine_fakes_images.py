"""A model that reads images on SGLang, through FakeSGLangServer (a GPU-only edge; it reads
``image_data`` as SGLang's Qwen2-VL processor does): the client's /generate body, the same
tokens as the embedded engine, a refused mismatch, and a real job playing the ``gui`` screens on
three such servers. vLLM, which takes no images beside token ids, is refused at launch."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e.test_chat_job import run_two_steps
from tests.e2e.test_gui_job import JOB as GUI_JOB
from tests.integration.fake_engines import FakeSGLangServer, running
from tests.unit.test_engine_images import png
from tiderl.engine.clients import (
    EmbeddedClient,
    EngineRequestError,
    GenerateResult,
    SGLangClient,
)
from tiderl.engine.config import VLLM_NO_IMAGES, EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.request import Images, SamplingParams
from tiderl.env.images import png_data_url
from tiderl.launch.job import LaunchError, check_architecture
from tiderl.models.image_turns import ImagePlacer, PlacedTurn
from tiderl.models.loading import load_config, load_model
from tiderl.models.random_init import write_random_checkpoint
from tiderl.models.vision_inputs import image_settings
from tiderl.profile import load_profile

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-vl")
    write_random_checkpoint("tiny-vl", folder, tokenizer="bpe")
    return folder


def placed(model: Path, screens: list[bytes]) -> tuple[PlacedTurn, Images]:
    """Text ids after ``screens``, each placed as its expanded placeholder run."""
    config = load_config(model)
    turn = ImagePlacer(config, image_settings(model, config), templated=False).place(
        list(range(40, 60)), screens)
    return turn, [(ref, turn.data[ref.key]) for ref in turn.images]


async def on_sglang(url: str, ids: list[int], images: Images) -> GenerateResult:
    async with SGLangClient(url) as client:
        return await client.generate("t", ids, GREEDY, images=images)


def test_sglang_generates_from_images_as_the_embedded_engine_does(model):
    screens = [png(56, 84, 1), png(112, 56, 2)]
    turn, images = placed(model, screens)
    assert [ref.num_tokens for ref in turn.images] == [6, 8]  # 28-pixel merged patches
    loaded = load_model(model)
    engine = LLMEngine(loaded, EngineConfig(kv_cache_tokens=2048), loaded.config.eos_token_id,
                       model_folder=str(model))
    expected = asyncio.run(EmbeddedClient(engine).generate("t", turn.ids, GREEDY, images=images))
    fake = FakeSGLangServer(model)
    with running(fake) as url:
        got = asyncio.run(on_sglang(url, turn.ids, images))
        # the same runs with another picture in the first one: other log-probs
        recolored = [(images[0][0], png(56, 84, 3)), images[1]]
        other = asyncio.run(on_sglang(url, turn.ids, recolored))
    assert got.output_ids == expected.output_ids
    assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert other.logprobs[0] != pytest.approx(got.logprobs[0], abs=1e-4)
    body = fake.calls[0][1]
    assert body["input_ids"] == turn.ids  # every run expanded: vision_start, pads, vision_end
    assert body["image_data"] == [png_data_url(s) for s in screens]  # in the runs' order


def test_an_image_that_does_not_fill_its_run_is_refused(model):
    turn, images = placed(model, [png(56, 84, 1)])
    start = turn.images[0].offset
    shorter = turn.ids[:start] + turn.ids[start + 1:]  # one pad less than the image's tokens
    fake = FakeSGLangServer(model)
    with running(fake) as url, pytest.raises(EngineRequestError, match="run of 5"):
        asyncio.run(on_sglang(url, shorter, images))


def test_a_job_on_a_vl_model_rolls_out_the_gui_screens_on_sglang(model, tmp_path):
    fakes = [FakeSGLangServer(model, kv_cache_tokens=4096) for _ in range(3)]
    with running(fakes[0]) as u0, running(fakes[1]) as u1, running(fakes[2]) as u2:
        metrics, episodes = run_two_steps(
            [*GUI_JOB, f"model.path={model}", "engine.backend=sglang",
             f"engine.urls=[{u0}, {u1}, {u2}]"], tmp_path)
    assert sum(m["trained_samples"] for m in metrics) > 0
    sent = [body for fake in fakes for path, body in fake.calls if path == "/generate"]
    assert sent and all(body.get("image_data") for body in sent)  # every turn sees a screen
    assert any(turn["restart"] for e in episodes for turn in e["turns"][1:])  # pruned


def test_launch_refuses_a_vl_model_on_vllm(model):
    profile = load_profile("local", [f"model.path={model}", "engine.backend=vllm",
                                     "runtime.device=cuda"])
    with pytest.raises(LaunchError, match="qwen2_vl model: vLLM's /v1/completions") as error:
        check_architecture(profile)
    assert VLLM_NO_IMAGES in str(error.value)
