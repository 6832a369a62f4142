"""`tiderl engine serve` with a model that reads images (a tiny Qwen2-VL folder): a completion
with images answers as the in-process engine does, its next turn hits the cached blocks, and
images that do not fit are a one-line 400 while the server keeps serving."""

import asyncio

import pytest

from tests.integration.serving import free_port, serving
from tests.unit.test_engine_images import joined, png
from tiderl.engine.clients import EngineRequestError, TideRLHTTPClient
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.request import SamplingParams
from tiderl.models.config import ModelConfig
from tiderl.models.image_turns import ImagePlacer, PlacedTurn
from tiderl.models.init import write_random_checkpoint
from tiderl.models.loading import model_from_config
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
            "--kv-cache-tokens", "1024", "--block-size", str(BLOCK)]

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
