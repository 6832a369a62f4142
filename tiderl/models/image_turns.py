"""A turn's images among its token ids, for a model that reads images (Qwen2-VL).

An environment's messages carry screenshots as PNG image parts. The token ids of a turn hold,
for each image, ``<|vision_start|>``, one ``<|image_pad|>`` per LLM token of the image (its
patch grid merged 2x2) and ``<|vision_end|>``; the pixels themselves never enter the ids: an
:class:`~tiderl.core.types.ImageRef` names the pads (offset, count, grid) and the image's content
hash, under which the PNG bytes travel beside the trajectory, to the engine (which encodes each
image once and caches its embeddings by that hash) and to the trainer.

:class:`ImagePlacer` places them. With a chat template (Qwen2-VL's renders each image part as
``<|vision_start|><|image_pad|><|vision_end|>``) the single pad of each image is widened to its
token count; without one (the word-level tokenizer) each image's placeholders go before the
turn's text, screenshot first, as the simulator's multimodal turns are laid out.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tiderl.core.types import ImageRef
from tiderl.models.chat import ChatEncoder, TurnEncoder
from tiderl.models.qwen2_vl import Qwen2VLConfig
from tiderl.models.vision_inputs import (
    ImageSettings,
    image_digest,
    image_grid,
    image_placeholder_ids,
    image_settings,
)


@dataclass
class PlacedTurn:
    """A turn's ids with its images placed: ``images`` index into ``ids``; ``data``: the PNG
    bytes by content hash."""

    ids: list[int]
    images: list[ImageRef] = field(default_factory=list)
    data: dict[str, bytes] = field(default_factory=dict)


class ImagePlacer:
    def __init__(self, config: Qwen2VLConfig, settings: ImageSettings, templated: bool) -> None:
        """``templated``: the ids come from a chat template that marks each image in place."""
        self.config = config
        self.settings = settings
        self.templated = templated

    def place(self, ids: Sequence[int], images: Sequence[bytes]) -> PlacedTurn:
        """``ids`` with ``images`` (PNG bytes, in message order) placed; a ValueError when a
        templated turn marks another number of images than it has."""
        refs, data, out = [], {}, []
        start, pad, end = (self.config.vision_start_token_id, self.config.image_token_id,
                           self.config.vision_end_token_id)
        if not self.templated:
            for png in images:
                key, grid, num_tokens = self._describe(png)
                refs.append(ImageRef(key, len(out) + 1, num_tokens, grid))
                data[key] = png
                out += image_placeholder_ids(num_tokens, self.config)
            return PlacedTurn(out + list(ids), refs, data)
        marks = [i for i in range(1, len(ids) - 1)
                 if ids[i] == pad and ids[i - 1] == start and ids[i + 1] == end]
        if len(marks) != len(images):
            raise ValueError(f"the chat template marked {len(marks)} images in a turn with "
                             f"{len(images)}")
        at = 0
        for mark, png in zip(marks, images, strict=True):
            key, grid, num_tokens = self._describe(png)
            out += ids[at:mark]
            refs.append(ImageRef(key, len(out), num_tokens, grid))
            data[key] = png
            out += [pad] * num_tokens
            at = mark + 1
        return PlacedTurn(out + list(ids[at:]), refs, data)

    def _describe(self, png: bytes) -> tuple[str, tuple[int, int, int], int]:
        """(content hash, patch grid, LLM tokens) of an image, from its size alone (the pixels
        are decoded where they are encoded: the engine, the trainer)."""
        from PIL import Image  # Pillow: a dependency of matplotlib

        width, height = Image.open(io.BytesIO(png)).size
        grid, num_tokens = image_grid(height, width, self.settings)
        return image_digest(png), grid, num_tokens


def image_placer(folder: str | Path | None, config: object,
                 encoder: TurnEncoder) -> ImagePlacer | None:
    """The placer of a model that reads images (its folder's image settings; templated when
    ``encoder`` applies a chat template), or None for a text model."""
    if not isinstance(config, Qwen2VLConfig):
        return None
    return ImagePlacer(config, image_settings(folder, config), isinstance(encoder, ChatEncoder))
