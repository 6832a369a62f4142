"""The trainer's log-probabilities of samples with images (tiny Qwen2-VL) through a backend:
packed, chunked, the pixels decoded from the samples' PNG bytes, against the model's dense
forward; the vision tower frozen or trained."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_engine_images import png
from tiderl.models.image_turns import ImagePlacer
from tiderl.models.qwen2 import token_logprobs
from tiderl.models.qwen2_vl import span_positions
from tiderl.models.random_init import init_model
from tiderl.models.vision_inputs import preprocess_image
from tiderl.trainer.batch import pack
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.sample import TrainSample


def sample(model, seq_id: str, pictures: list[bytes], words: list[int]) -> TrainSample:
    """Images, then words; the loss on the last half of the words (one sample ends in
    context after them: an image that the packed forward cuts off)."""
    placer = ImagePlacer(model.config, model.image_settings, templated=False)
    turn = placer.place(words, pictures)
    n = len(turn.ids)
    mask = tuple(int(i >= n - len(words) // 2) for i in range(n))
    return TrainSample(seq_id, tuple(turn.ids), mask, (0.0,) * n, 1.0, 0,
                       tuple(turn.images), turn.data)


def dense_logprobs(model, s: TrainSample) -> torch.Tensor:
    pixels = torch.cat([preprocess_image(s.image_data[r.key], model.image_settings).pixel_values
                        for r in s.images])
    spans = [(r.offset, r.grid) for r in s.images]
    positions, _ = span_positions(len(s.input_ids), spans, model.config.vision.spatial_merge_size)
    rows = torch.cat([torch.arange(r.offset, r.offset + r.num_tokens) for r in s.images])
    logits = model(torch.tensor([s.input_ids]), positions[:, None], pixel_values=pixels,
                   image_grid_thw=[grid for _, grid in spans], image_rows=rows)
    return token_logprobs(lambda ids: logits, torch.tensor([s.input_ids]),
                          torch.tensor([s.loss_mask]))[0]


@pytest.mark.parametrize("train_vision", [False, True])
def test_backend_logprobs_with_images_equal_the_dense_forward(train_vision):
    model = init_model("tiny-vl", seed=2)
    model.freeze_vision(not train_vision)
    pad = model.config.image_token_id  # sampled by the model: text there
    samples = [sample(model, "a", [png(56, 84, 1), png(56, 56, 2)], list(range(5, 25))),
               sample(model, "b", [png(84, 56, 3)], [*range(30, 36), pad, *range(37, 42)])]
    batch = pack(samples)
    assert batch.images is not None and [len(row) for row in batch.images] == [2, 1]
    backend = make_backend("ddp", model, chunk_tokens=7)
    got = backend.logprobs(batch.input_ids, batch.loss_mask, batch.images)
    for row, s in enumerate(samples):
        with torch.no_grad():
            want = dense_logprobs(model, s)
        torch.testing.assert_close(got[row, :len(want)], want, atol=1e-5, rtol=0)
    got.sum().backward()
    vision_grads = [p.grad for p in model.visual.parameters()]
    assert all(g is not None for g in vision_grads) == train_vision
    assert all(p.grad is not None for p in model.model.layers.parameters())
