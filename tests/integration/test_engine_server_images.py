"""`tiderl engine serve` with a model that reads images (a tiny Qwen2-VL folder): a completion
with images answers as the in-process engine does, its next turn hits the cached blocks, and
images that do not fit are a one-line 400 while the server keeps serving; an image once sent
goes by its key."""

import asyncio
import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.integration.serving import free_port, serving
from tests.unit.test_engine_images import joined, png
from tiderl.engine.clients import EngineRequestError, TideRLHTTPClient
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.request import SamplingParams
from tiderl.models.config import ModelConfig
from tiderl.models.image_turns import ImagePlacer, PlacedTurn
from tiderl.models.loading import model_from_config
from tiderl.models.random_init import write_random_checkpoint
from tiderl.models.vision_inputs import image_settings

GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
BLOCK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    write_random_checkpoint("tiny-vl", root / "model", 3)
    return root


def test_images_over_http_equal_the_in_process_engine(folder):
    model, _ = model_from_config(ModelConfig(path=str(folder / "model")))
    placer = ImagePlacer(model.config, image_settings(folder / "model", model.config), False)
    first = placer.place([5, 6, 7], [png(56, 84, 1)])
    local = LLMEngine(model, EngineConfig(kv_cache_tokens=1024, block_size=BLOCK), None,
                      model_folder=str(folder / "model"))
    prompt, images = joined(first)
    want = asyncio.run(local.generate("t", prompt, GREEDY, images))
    port = free_port()
    args = ["engine", "serve", "--model", str(folder / "model"), "--port", str(port),
            "--set", "engine.kv_cache_tokens=1024", "--set", f"engine.block_size={BLOCK}"]

    async def turns(url):
        async with TideRLHTTPClient(url) as client:
            one = await client.generate("t", prompt, GREEDY, images=images)
            second, refs = joined(first, PlacedTurn(one.output_ids),
                                  placer.place([8, 9], [png(56, 56, 2)]))
            two = await client.generate("t", second, GREEDY, images=refs)
            (ref, image), = images
            with pytest.raises(EngineRequestError) as bad:
                await client.generate("u", prompt, GREEDY, images=[(ref.shifted(1), image)])
            again = await client.generate("v", prompt, GREEDY, images=images)
            return one, two, bad.value, again

    with serving(args, port, folder / "server.log") as (url, _):
        one, two, bad, again = asyncio.run(turns(url))
    assert (one.output_ids, one.logprobs) == (want.output_ids, pytest.approx(want.logprobs,
                                                                            abs=1e-5))
    # turn 1's KV: its prompt and 4 of its 5 outputs (the last one's comes with turn 2)
    assert two.num_cached_tokens == (len(prompt) + 4) // BLOCK * BLOCK > 0
    assert "400" in str(bad) and "are not its image-pad tokens" in str(bad)
    assert "\n" not in str(bad)
    assert again.output_ids == want.output_ids


def test_an_image_goes_by_key_once_sent_and_again_after_the_tower_changed(folder):
    """The client sends an image's bytes once; the next turns name it by key. Weights whose
    vision tower differs drop the server's embeddings: the next turn's key alone is answered
    409 ``image_missing`` and the client sends the bytes again, within the same call. Weights
    with the same tower keep them."""
    tower = folder / "tower"
    shutil.copytree(folder / "model", tower)
    state = load_file(tower / "model.safetensors")
    weight = state["visual.patch_embed.proj.weight"]
    weight += torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    save_file(state, tower / "model.safetensors")
    model, _ = model_from_config(ModelConfig(path=str(folder / "model")))
    placer = ImagePlacer(model.config, image_settings(folder / "model", model.config), False)
    prompt, images = joined(placer.place([5, 6, 7], [png(56, 84, 1)]))
    port = free_port()
    args = ["engine", "serve", "--model", str(folder / "model"), "--port", str(port),
            "--set", "engine.kv_cache_tokens=1024", "--set", f"engine.block_size={BLOCK}",
            "--set", "engine.kv_on_update=flush"]
    bodies: list[dict] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path == "/v1/completions":
            bodies.append(json.loads(request.content))

    async def turns(url):
        async with TideRLHTTPClient(url) as client:
            client.http.event_hooks = {"request": [record], "response": []}
            first = await client.generate("a", prompt, GREEDY, images=images)
            by_key = await client.generate("b", prompt, GREEDY, images=images)
            await client.update_weights(str(tower), 1)
            new_tower = await client.generate("c", prompt, GREEDY, images=images)
            await client.update_weights(str(tower), 2)  # the same tower: embeddings kept
            kept = await client.generate("d", prompt, GREEDY, images=images)
            return first, by_key, new_tower, kept

    with serving(args, port, folder / "server-keys.log") as (url, _):
        first, by_key, new_tower, kept = asyncio.run(turns(url))
    assert ["png" in body["images"][0] for body in bodies] == [True, False, False, True, False]
    assert by_key.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    assert new_tower.logprobs[0] != pytest.approx(first.logprobs[0], abs=1e-4)
    assert kept.logprobs == pytest.approx(new_tower.logprobs, abs=1e-5)
