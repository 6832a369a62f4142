"""Images of a training batch, as a model that reads images takes them.

A sample keeps its images by reference (:class:`~tiderl.core.types.ImageRef`: offset, token
count, patch grid, content hash) with their PNG bytes. :func:`batch_images` decodes the pixels
(kept by hash, so a screenshot shared by a task's segments, or its group, is decoded once per
rank) and computes every row's multimodal rotary positions; the packed forward
(:func:`tiderl.models.qwen2.packed_token_logprobs`) then cuts both to the tokens it runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from tiderl.core.types import ImageRef
from tiderl.models.image_rows import BatchImages, RowImages
from tiderl.models.qwen2_vl import Qwen2VLConfig, span_positions
from tiderl.models.vision_inputs import ImageSettings, preprocess_image


class PixelCache:
    """Decoded images by content hash (an LRU of ``capacity``)."""

    def __init__(self, settings: ImageSettings, capacity: int = 256) -> None:
        self.settings = settings
        self.capacity = capacity
        self._pixels: OrderedDict[str, torch.Tensor] = OrderedDict()

    def pixels(self, ref: ImageRef, png: bytes) -> torch.Tensor:
        cached = self._pixels.get(ref.key)
        if cached is not None:
            self._pixels.move_to_end(ref.key)
            return cached
        image = preprocess_image(png, self.settings)
        if tuple(image.grid) != tuple(ref.grid):
            raise ValueError(f"image {ref.key[:12]}: its pixels give grid {tuple(image.grid)}, "
                             f"the sample says {tuple(ref.grid)} (other image settings than "
                             "the rollout's?)")
        self._pixels[ref.key] = image.pixel_values
        while len(self._pixels) > self.capacity:
            self._pixels.popitem(last=False)
        return image.pixel_values


def batch_images(config: Qwen2VLConfig, cache: PixelCache, input_ids: torch.Tensor,
                 images: Sequence[RowImages], device: torch.device | str) -> BatchImages:
    """The images of a right-padded batch ``input_ids`` [B, T] (``images[b]``: row b's)."""
    rows, positions = [], []
    for ids, row in zip(input_ids.tolist(), images, strict=True):
        ordered = sorted(row, key=lambda item: item[0].offset)
        rows.append([(ref.offset, ref.num_tokens, cache.pixels(ref, png).to(device), ref.grid)
                     for ref, png in ordered])
        positions.append(span_positions(len(ids), [(ref.offset, ref.grid) for ref, _ in ordered],
                                        config.vision.spatial_merge_size)[0])
    return BatchImages(torch.stack(positions, dim=1).to(device), rows)
