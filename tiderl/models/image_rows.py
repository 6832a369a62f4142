"""A training batch's images as the packed forward reads them: a protocol module that imports no
model, so that the text model (:func:`tiderl.models.qwen2.packed_token_logprobs`) can take a
batch's images and the trainer can carry them without importing the vision model.
:func:`tiderl.models.image_batch.batch_images` builds a :class:`BatchImages`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiderl.core.types import ImageRef

RowImages = Sequence[tuple[ImageRef, bytes]]  # a row's images, offsets into the row


@dataclass(frozen=True)
class BatchImages:
    """``positions`` [3, B, T]: each row's mrope positions, from its images' spans (padding,
    and any image-pad token the model sampled, are text);
    ``rows``: per row, (offset, token count, pixel values, grid) of each image, in order (the
    grid as :attr:`ImageRef.grid <tiderl.core.types.ImageRef.grid>`: (t, h, w) in patches)."""

    positions: torch.Tensor
    rows: list[list[tuple[int, int, torch.Tensor, tuple[int, int, int]]]]

    def packed(self, lengths: Sequence[int], starts: Sequence[int]
               ) -> tuple[torch.Tensor | None, list[tuple[int, int, int]], torch.Tensor]:
        """What a packed forward of each row's first ``lengths[b]`` tokens, row b from packed
        index ``starts[b]``, reads: the pixel values and grids of the images within them, row
        after row, and the packed indices of their tokens (``image_rows``)."""
        pixels, grids, rows = [], [], []
        for row, length, start in zip(self.rows, lengths, starts, strict=True):
            for offset, count, values, grid in row:
                if offset + count <= length:
                    pixels.append(values)
                    grids.append(grid)
                    rows.append(torch.arange(start + offset, start + offset + count))
        device = self.positions.device
        index = torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long,
                                                                     device=device)
        return (torch.cat(pixels) if pixels else None), grids, index
