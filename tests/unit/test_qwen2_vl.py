"""Qwen2-VL and Qwen2.5-VL against transformers (fp32, CPU, the same random weights): logits on
a prompt with two images of different sizes, mrope positions, image preprocessing, folders
written either way; and our own paths (packed, paged) against our dense forward."""

from __future__ import annotations

import dataclasses
import io
import json
import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tiderl.cli.main import app as cli
from tiderl.models.attention import PagedBatch
from tiderl.models.config import ModelConfig
from tiderl.models.folder import ModelLoadError, load_state_dict, load_tokenizer, save_model
from tiderl.models.loading import load_model, model_from_config
from tiderl.models.qwen2_vl import Qwen2VLConfig, Qwen2VLForCausalLM, mrope_positions
from tiderl.models.random_init import init_model, size_config
from tiderl.models.vision import VisionConfig
from tiderl.models.vision_inputs import (
    ImageSettings,
    batch_images,
    image_digest,
    image_placeholder_ids,
    preprocess_image,
    smart_resize,
)
from tiderl.models.vocab import VISION_TOKENS, VOCAB

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[dev]')")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil,
)

HF_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
              "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
# Qwen2.5-VL's tower with windows of 2 x 2 merged tokens, block 1 attending to the whole image
TINY_25_VISION = VisionConfig(kind="qwen2_5_vl", depth=2, width=64, num_heads=4,
                              intermediate_size=96, out_hidden_size=128, hidden_act="silu",
                              window_size=56, fullatt_block_indexes=(1,))
IMAGE_SIZES = ((70, 100), (120, 90))  # (height, width): 2 x 4 and 4 x 3 LLM tokens
BLOCK_SIZE = 4


def vl_config(kind: str) -> Qwen2VLConfig:
    config = size_config("tiny-vl")
    assert isinstance(config, Qwen2VLConfig)
    return config if kind == "qwen2_vl" else dataclasses.replace(config, vision=TINY_25_VISION)


def random_model(kind: str, seed: int = 0) -> Qwen2VLForCausalLM:
    """Random weights, biases and norms too, so that every parameter matters."""
    model = init_model("tiny-vl", seed, vl_config(kind))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def random_image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def prompt(config: Qwen2VLConfig, seed: int = 0):
    """Text, an image, text, another image of another size, text: (ids, images)."""
    rng = random.Random(seed)
    images = [preprocess_image(random_image(h, w, seed + i))
              for i, (h, w) in enumerate(IMAGE_SIZES)]

    def text(n: int) -> list[int]:
        return [rng.randrange(4, len(VOCAB)) for _ in range(n)]

    ids = [*text(5), *image_placeholder_ids(images[0].num_tokens, config), *text(3),
           *image_placeholder_ids(images[1].num_tokens, config), *text(6)]
    return ids, images


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def saved(request, tmp_path_factory):
    """(kind, our model, transformers' model loaded from the folder ours saved)."""
    folder = tmp_path_factory.mktemp(request.param)
    ours = random_model(request.param)
    save_model(ours, folder)
    hf_class = getattr(transformers, HF_CLASSES[request.param])
    reference, info = hf_class.from_pretrained(folder, dtype=torch.float32,
                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return request.param, ours, reference.eval()


def hf_logits(reference, ids: list[int], images) -> torch.Tensor:
    pixel_values, grids = batch_images(images)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return reference(input_ids=input_ids, pixel_values=pixel_values,
                         image_grid_thw=torch.tensor(grids),
                         mm_token_type_ids=(input_ids == reference.config.image_token_id).int()
                         ).logits[0]


def test_logits_equal_transformers(saved):
    _, ours, reference = saved
    ids, images = prompt(ours.config)
    pixel_values, grids = batch_images(images)
    with torch.no_grad():
        got = ours(torch.tensor([ids]), pixel_values=pixel_values, image_grid_thw=grids)[0]
        by_embeds = ours(torch.tensor([ids]), image_grid_thw=grids,
                         image_embeds=ours.encode_images(pixel_values, grids))[0]
    torch.testing.assert_close(got, hf_logits(reference, ids, images), atol=1e-5, rtol=1e-5)
    assert torch.equal(got, by_embeds)
    other = [images[0], preprocess_image(random_image(*IMAGE_SIZES[1], seed=99))]
    with torch.no_grad():  # the images matter, from their first token on
        changed = ours(torch.tensor([ids]), pixel_values=batch_images(other)[0],
                       image_grid_thw=grids)[0]
    first = ids.index(ours.config.image_token_id, ids.index(ours.config.vision_end_token_id))
    assert torch.equal(changed[:first], got[:first])
    assert (changed[first:] - got[first:]).abs().max() > 1e-3


def test_mrope_positions_equal_get_rope_index(saved):
    _, ours, reference = saved
    ids, images = prompt(ours.config, seed=3)
    grids = [image.grid for image in images]
    input_ids = torch.tensor([ids])
    expected, deltas = reference.model.get_rope_index(
        input_ids, (input_ids == ours.config.image_token_id).int(), torch.tensor(grids))
    positions, delta = mrope_positions(ids, grids, ours.config)
    assert torch.equal(positions, expected[:, 0]) and delta == int(deltas[0, 0])
    assert delta < 0  # an image's tokens take fewer positions than tokens
    ending, end_delta = mrope_positions(ids[:-7], grids, ours.config)  # ends in <|image_pad|>
    longer, _ = mrope_positions(ids[:-7] + ids[-7:], grids, ours.config)
    assert torch.equal(longer[:, :len(ids) - 7], ending)  # a prefix keeps its positions
    after = torch.arange(len(ids) - 7, len(ids)) + end_delta
    assert torch.equal(longer[:, len(ids) - 7:], after.expand(3, -1))  # i + delta, all three


def test_a_transformers_folder_loads_with_equal_logits(saved, tmp_path):
    """save_pretrained's config.json layout and weight names, read back by ours."""
    kind, ours, reference = saved
    reference.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == ours.config and loaded.config.model_type == kind
    ids, images = prompt(ours.config, seed=5)
    pixel_values, grids = batch_images(images)
    with torch.no_grad():
        got = loaded(torch.tensor([ids]), pixel_values=pixel_values, image_grid_thw=grids)[0]
    torch.testing.assert_close(got, hf_logits(reference, ids, images), atol=1e-5, rtol=1e-5)


def test_transformers_in_memory_weight_names_load(saved, tmp_path):
    _, ours, _ = saved
    save_model(ours, tmp_path)
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v
               for k, v in load_state_dict(tmp_path).items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    from safetensors.torch import save_file

    save_file(renamed, str(tmp_path / "model.safetensors"))
    loaded = load_model(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_config_reads_the_hub_layout():
    """The hub's config.json of Qwen2-VL / Qwen2.5-VL: language fields flat, rope_scaling
    {type: mrope}, in_chans; transformers 5's (what to_hf writes): nested text_config."""
    for kind in HF_CLASSES:
        config = vl_config(kind)
        hf = config.to_hf()
        assert Qwen2VLConfig.from_hf(hf) == config
        text = dict(hf.pop("text_config"))
        rope = text.pop("rope_parameters")
        vision = dict(hf["vision_config"])
        vision["in_chans"] = vision.pop("in_channels")
        legacy = {**hf, **text, "model_type": kind, "rope_theta": rope["rope_theta"],
                  "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
                  "vision_config": vision}
        assert Qwen2VLConfig.from_hf(legacy) == config
        hf_config = getattr(transformers, HF_CLASSES[kind].replace(
            "ForConditionalGeneration", "Config"))(**legacy)
        assert Qwen2VLConfig.from_hf(hf_config.to_dict()) == config


def test_preprocessing_equals_the_image_processor():
    """Against transformers' PIL backend (its default backend needs torchvision, not
    installed here): upscaled, downscaled, odd sizes, and a PNG with transparency."""
    settings = ImageSettings(max_pixels=28 * 28 * 16)
    processor = Qwen2VLImageProcessorPil(min_pixels=settings.min_pixels,
                                         max_pixels=settings.max_pixels)
    pictures: list = [random_image(h, w, i) for i, (h, w) in
                      enumerate([(20, 30), (300, 200), (57, 113), (29, 400)])]
    from PIL import Image

    rgba = np.random.default_rng(9).integers(0, 256, (60, 90, 4), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(png, format="PNG")
    pictures.append(png.getvalue())
    for picture in pictures:
        ours = preprocess_image(picture, settings)
        given = Image.open(io.BytesIO(picture)) if isinstance(picture, bytes) else picture
        expected = processor(images=[given], return_tensors="np")
        assert ours.grid == tuple(expected["image_grid_thw"][0])
        assert np.array_equal(ours.pixel_values.numpy(), expected["pixel_values"])
        assert ours.num_tokens == len(ours.pixel_values) // 4
        assert ours.digest == image_digest(picture)
    assert smart_resize(20, 30, 28, 56 * 56, 28 * 28 * 16) == (56, 84)  # grown to min_pixels
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100, 28, 56 * 56, 28 * 28 * 1280)


def test_placeholders_and_digests():
    config = vl_config("qwen2_vl")
    assert image_placeholder_ids(3, config) == [
        config.vision_start_token_id, *[config.image_token_id] * 3, config.vision_end_token_id]
    a = random_image(4, 6, 0)
    assert image_digest(a) == image_digest(a.copy()) != image_digest(a.reshape(6, 4, 3))


def dense_logits(model, ids: list[int], images) -> torch.Tensor:
    pixel_values, grids = batch_images(images)
    with torch.no_grad():
        return model(torch.tensor([ids]), pixel_values=pixel_values, image_grid_thw=grids)[0]


def test_packed_forward_and_target_logprobs_equal_dense():
    model = random_model("qwen2_5_vl", seed=2)
    seqs = [prompt(model.config, seed=s) for s in (0, 1)]
    seqs[1] = (seqs[1][0][:-4], seqs[1][1])  # another length
    positions = torch.cat([mrope_positions(ids, [i.grid for i in imgs], model.config)[0]
                           for ids, imgs in seqs], dim=1)
    ids = torch.tensor([t for s, _ in seqs for t in s])
    pixel_values, grids = batch_images([i for _, imgs in seqs for i in imgs])
    cu_seqlens = [0, len(seqs[0][0]), len(ids)]
    dense = torch.cat([dense_logits(model, s, imgs) for s, imgs in seqs])
    with torch.no_grad():
        embeds = model.encode_images(pixel_values, grids)
        packed = model(ids, positions, image_embeds=embeds, cu_seqlens=cu_seqlens)
        rows = torch.tensor([0, 7, 30, len(ids) - 2])
        targets = ids[rows + 1]
        picked = model(ids, positions, image_embeds=embeds, cu_seqlens=cu_seqlens,
                       targets=targets, target_rows=rows, chunk_tokens=3)
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)
    expected = torch.log_softmax(dense[rows], -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(picked, expected, atol=1e-5, rtol=1e-5)


def test_paged_prefill_through_an_image_and_decode_equal_dense():
    """Sequence 0's first chunk ends inside its first image; decode tokens get plain 1-D
    positions i + delta."""
    model = random_model("qwen2_vl", seed=4)
    config = model.config
    seqs = [prompt(config, seed=s) for s in (0, 1)]
    extra = [[11, 12], [13, 14]]  # decoded tokens
    full = [ids + more for (ids, _), more in zip(seqs, extra, strict=True)]
    expected = [dense_logits(model, ids, imgs) for ids, (_, imgs) in zip(full, seqs,
                                                                         strict=True)]
    embeds = [model.encode_images(*batch_images(imgs)).detach() for _, imgs in seqs]
    pos = [mrope_positions(ids, [i.grid for i in imgs], config) for ids, imgs in seqs]
    first = 10  # inside sequence 0's first image (its tokens start at 6)
    steps = [{0: first, 1: len(seqs[1][0])}, {0: len(seqs[0][0]) - first}, {0: 1, 1: 1},
             {0: 1, 1: 1}]
    pool = list(range(64))
    random.Random(0).shuffle(pool)
    cache = model.new_kv_cache(64, BLOCK_SIZE)
    tables: dict[int, list[int]] = {0: [], 1: []}
    done, used = {0: 0, 1: 0}, {0: 0, 1: 0}
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for step in steps:
        order = sorted(step)
        for s in order:
            while len(tables[s]) * BLOCK_SIZE < done[s] + step[s]:
                tables[s].append(pool.pop())
        _, batch = PagedBatch.build([tables[s] for s in order], [done[s] for s in order],
                                    [step[s] for s in order], BLOCK_SIZE)
        ids, positions, rows = [], [], []
        for s in order:
            new = full[s][done[s]:done[s] + step[s]]
            ids += new
            known = pos[s][0].shape[1]
            positions.append(pos[s][0][:, done[s]:done[s] + step[s]] if done[s] < known else
                             (torch.arange(done[s], done[s] + step[s]) + pos[s][1]).expand(3, -1))
            count = new.count(config.image_token_id)
            rows.append(embeds[s][used[s]:used[s] + count])
            used[s] += count
        with torch.no_grad():
            out = model.forward_paged(torch.tensor(ids), torch.cat(positions, dim=1), cache,
                                      batch, image_embeds=torch.cat(rows))
        for i, s in enumerate(order):
            got[s].append(out[batch.query_start_loc[i]:batch.query_start_loc[i + 1]])
            done[s] += step[s]
    for s in (0, 1):
        torch.testing.assert_close(torch.cat(got[s]), expected[s], atol=1e-5, rtol=1e-5)


def test_freeze_vision_keeps_the_tower_out_of_training():
    model = random_model("qwen2_vl")
    model.freeze_vision()
    ids, images = prompt(model.config)
    pixel_values, grids = batch_images(images)
    model(torch.tensor([ids]), pixel_values=pixel_values, image_grid_thw=grids).sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in model.visual.parameters())
    assert all(p.grad is not None for p in model.model.parameters())
    model.freeze_vision(False)
    assert all(p.requires_grad for p in model.visual.parameters())


def test_model_init_tiny_vl_folder_loads_in_ours_and_transformers(tmp_path):
    result = CliRunner().invoke(cli, ["model", "init", "--size", "tiny-vl", "--out",
                                      str(tmp_path), "--seed", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(result.output)["files"]) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
         "preprocessor_config.json"])
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_vl"
    ours = load_model(tmp_path)
    assert ours.config == size_config("tiny-vl")
    assert ours.image_settings == ImageSettings() == init_model("tiny-vl").image_settings
    tokenizer = load_tokenizer(tmp_path)
    config = ours.config
    assert [tokenizer.token_to_id(t) for t in VISION_TOKENS] == [
        config.vision_start_token_id, config.vision_end_token_id, config.image_token_id]
    assert tokenizer.get_vocab_size() == config.vocab_size == len(VOCAB) + 3
    reference = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    ids, images = prompt(config, seed=7)
    expected = hf_logits(reference, ids, images)
    torch.testing.assert_close(dense_logits(ours, ids, images), expected, atol=1e-5, rtol=1e-5)
    picture = random_image(*IMAGE_SIZES[0], seed=7)
    assert np.array_equal(processor(images=[picture], return_tensors="np")["pixel_values"],
                          images[0].pixel_values.numpy())
    from_profile, profile_tokenizer = model_from_config(ModelConfig(size="tiny-vl", seed=3))
    assert isinstance(from_profile, Qwen2VLForCausalLM)
    assert torch.equal(from_profile.visual.patch_embed.proj.weight,
                       ours.visual.patch_embed.proj.weight)
    assert profile_tokenizer.token_to_id(VISION_TOKENS[2]) == config.image_token_id


def test_a_broken_vl_folder_is_one_line_naming_the_file(tmp_path):
    save_model(random_model("qwen2_vl"), tmp_path)
    config_file = tmp_path / "config.json"
    good = json.loads(config_file.read_text())

    def error() -> str:
        with pytest.raises(ModelLoadError) as caught:
            load_model(tmp_path)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    config_file.write_text(json.dumps({k: v for k, v in good.items() if k != "vision_config"}))
    assert "config.json" in error()
    broken_rope = dict(good["text_config"], rope_parameters={"rope_type": "default"})
    config_file.write_text(json.dumps(good | {"text_config": broken_rope}))
    assert "config.json" in error() and "mrope_section" in error()
    config_file.write_text(json.dumps(good | {"vision_config": good["vision_config"]
                                              | {"embed_dim": 32}}))
    assert "weights do not match config.json" in error()
    config_file.write_text(json.dumps(good))
    processor_file = tmp_path / "preprocessor_config.json"
    processor_file.write_text(json.dumps({"min_pixels": 100, "max_pixels": 28 * 28 * 4}))
    assert load_model(tmp_path).image_settings.max_pixels == 28 * 28 * 4
    processor_file.write_text(json.dumps({"min_pixels": 100, "max_pixels": 50}))
    assert "preprocessor_config.json" in error()
    processor_file.write_text("{")
    assert "preprocessor_config.json" in error()
    processor_file.unlink()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "model.safetensors" in error()
