"""The embedded engine with a model that reads images (tiny Qwen2-VL): its generation against
the model's dense forward, the prefix cache keyed on image hashes (exact hit counts), the vision
tower run once per image (its embeddings kept until the tower's weights change), and the errors
of images that do not fit the prompt."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch
from PIL import Image

from tests.native import native_or_skip
from tiderl.core.types import ImageRef
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.multimodal import ImagesMissing
from tiderl.engine.request import SamplingParams
from tiderl.models.image_turns import ImagePlacer, PlacedTurn
from tiderl.models.qwen2_vl import span_positions
from tiderl.models.random_init import init_model
from tiderl.models.vision_inputs import image_settings, preprocess_image

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def png(width: int, height: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(height, width, 3, generator=gen) * 255).to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def model():
    return init_model("tiny-vl", seed=1)


@pytest.fixture(scope="module")
def placer(model):
    return ImagePlacer(model.config, image_settings(None, model.config), templated=False)


def joined(*turns: PlacedTurn) -> tuple[list[int], list[tuple[ImageRef, bytes]]]:
    """The turns' ids back to back, with their images (offsets into the whole)."""
    ids, images = [], []
    for turn in turns:
        images += [(ref.shifted(len(ids)), turn.data[ref.key]) for ref in turn.images]
        ids += turn.ids
    return ids, images


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_generation_equals_the_dense_forward(model, placer, kernels):
    """Greedy tokens and their logprobs equal a greedy loop over the model's dense forward
    (mrope positions from the images' spans, the tower run inside it): prefill of two images
    of different shapes among text (an image-pad token between them is text), then decode
    steps at ``index + delta``."""
    images = [png(56, 84, 1), png(112, 56, 2)]
    pad = model.config.image_token_id  # sampled by the model between the images: text there
    prompt, refs = joined(placer.place([5, 6, 7, 8], images[:1]),
                          PlacedTurn([12, pad, 13]), placer.place([9, 10, 11], images[1:]))
    with native_or_skip():
        engine = LLMEngine(model, EngineConfig(kv_cache_tokens=512, block_size=BS,
                                               kernels=kernels), None)
    out = asyncio.run(engine.generate("t", prompt, GREEDY, refs))
    settings = image_settings(None, model.config)
    pixels = torch.cat([preprocess_image(p, settings).pixel_values for p in images])
    spans = [(ref.offset, ref.grid) for ref, _ in refs]
    rows = torch.cat([torch.arange(ref.offset, ref.offset + ref.num_tokens) for ref, _ in refs])
    ids, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            positions, _ = span_positions(len(ids), spans, model.config.vision.spatial_merge_size)
            logits = model(torch.tensor([ids]), positions[:, None], pixel_values=pixels,
                           image_grid_thw=[grid for _, grid in spans], image_rows=rows)
            logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
            token = int(logprobs.argmax())
            expected.append((token, float(logprobs[token])))
            ids.append(token)
    assert out.output_ids == [t for t, _ in expected]
    assert out.logprobs == pytest.approx([lp for _, lp in expected], abs=1e-5)
    assert engine.images.images_encoded == 2


def test_prefix_cache_keys_on_the_image_hash(model, placer):
    """A task's next turn hits every full block of its last context (its image included), and
    the tower does not run again for it; another picture of the same size, whose tokens are
    equal, hits nothing."""
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=512, block_size=BS), None)
    sampling = SamplingParams(max_tokens=3, temperature=0.0)
    first = placer.place([5, 6, 7], [png(56, 56, 1)])  # 1 + 4 + 1 image tokens, 3 words
    assert [ref.offset for ref in first.images] == [1] and len(first.ids) == 9

    async def turns():
        prompt, refs = joined(first)
        one = await engine.generate("t", prompt, sampling, refs)
        prompt, refs = joined(first, PlacedTurn(one.output_ids),
                              placer.place([8, 9], [png(56, 84, 2)]))
        two = await engine.generate("t", prompt, sampling, refs)
        other = placer.place([5, 6, 7], [png(56, 56, 3)])
        prompt, refs = joined(other)
        assert prompt == first.ids  # the same tokens: only the hash tells them apart
        three = await engine.generate("u", prompt, sampling, refs)
        return one, two, three

    one, two, three = asyncio.run(turns())
    # turn 1 computed 9 + 2 tokens (the last output's KV comes with the next turn): 2 blocks
    assert (one.num_cached_tokens, two.num_cached_tokens, three.num_cached_tokens) == (0, 8, 0)
    assert (engine.images.images_seen, engine.images.images_encoded) == (4, 3)


def test_images_that_do_not_fit_the_prompt_are_one_line_errors(model, placer):
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=512, block_size=BS), None)
    turn = placer.place([5, 6], [png(56, 56, 1)])
    (ref,) = turn.images
    image = turn.data[ref.key]
    with pytest.raises(ValueError, match="are not its image-pad tokens"):
        engine.add_request("t", turn.ids, GREEDY, [(ref.shifted(2), image)])
    with pytest.raises(ValueError, match="its pixels give"):
        engine.add_request("t", turn.ids, GREEDY, [(ref, png(56, 56, 2))])
    text = LLMEngine(init_model("tiny"), EngineConfig(kv_cache_tokens=512, block_size=BS), None)
    with pytest.raises(ValueError, match="reads no images"):
        text.add_request("t", [5, 6, 7], GREEDY, [(ref, image)])
    assert not engine.scheduler.has_unfinished  # nothing was queued


def test_embeddings_are_kept_by_key_until_the_tower_changes(placer):
    """An image named by key alone uses its cached embeddings, and one the engine does not
    hold is ImagesMissing; weights that leave the tower as it is keep the cache, a changed
    tower drops it."""
    own = init_model("tiny-vl", seed=1)  # this test changes its weights
    engine = LLMEngine(own, EngineConfig(kv_cache_tokens=512, block_size=BS), None)
    turn = placer.place([5, 6], [png(56, 56, 1)])
    (ref,) = turn.images
    by_key = [(ref, None)]
    with pytest.raises(ImagesMissing) as missing:
        engine.add_request("t", turn.ids, GREEDY, by_key)
    assert missing.value.keys == (ref.key,)
    engine.add_request("t", turn.ids, GREEDY, [(ref, turn.data[ref.key])])
    engine.add_request("u", turn.ids, GREEDY, by_key)
    state = {k: v.clone() for k, v in own.state_dict().items()}
    engine.update_weights(state, 1)  # every parameter, the tower's unchanged
    engine.add_request("v", turn.ids, GREEDY, by_key)
    assert engine.images.images_encoded == 1
    tower = {"visual.patch_embed.proj.weight": state["visual.patch_embed.proj.weight"] + 0.05}
    engine.update_weights(tower, 2)
    with pytest.raises(ImagesMissing):
        engine.add_request("w", turn.ids, GREEDY, by_key)
