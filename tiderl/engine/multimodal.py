"""Images in the embedded engine (a Qwen2-VL-architecture model).

A request's prompt holds each image as a run of image-pad tokens, named by an
:class:`~tiderl.core.types.ImageRef` (offset, count, grid, content hash) and sent with its PNG
bytes, or by its key alone where the engine holds it already. :class:`ImageEncoder` turns the
images into what a step needs:

- the vision tower runs once per image: its embeddings [tokens, hidden] are kept by content
  hash (an LRU of ``capacity`` images; dropped when the tower's weights change), so a task that
  comes back with the same screenshots in its context, or a group whose tasks share one,
  encodes nothing again;
- the prompt's multimodal rotary positions [3, L] and its ``delta``
  (:func:`~tiderl.models.qwen2_vl.span_positions`, from the images' spans: an image-pad token
  the model sampled itself is text): a token at index ``i >= L`` (an output)
  is at ``i + delta`` in all three components.

The prefix cache tells two images apart by their hash: a block whose tokens overlap an image
carries the image's hash in its content key
(:func:`tiderl.engine.kv_cache_manager.block_image_keys`), so equal pad tokens of
different pictures never hit each other, and a task resumed with the same images hits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiderl.core.types import ImageRef
from tiderl.models.qwen2_vl import Qwen2VLForCausalLM, span_positions
from tiderl.models.vision_inputs import ImageSettings, preprocess_image


@dataclass(frozen=True, slots=True)
class PromptImages:
    """A prompt's images: their refs (offsets into the prompt), embeddings (one tensor each,
    [num_tokens, hidden], in the refs' order), and the prompt's mrope positions."""

    refs: tuple[ImageRef, ...]
    embeds: tuple[torch.Tensor, ...]
    positions: torch.Tensor  # [3, prompt length] int64
    delta: int

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of sequence indices start..end-1 (outputs past the
        prompt: index + delta in each component)."""
        prompt = self.positions.shape[1]
        inside = self.positions[:, min(start, prompt):min(end, prompt)]
        past = torch.arange(max(start, prompt), max(end, prompt)) + self.delta
        return torch.cat((inside, past.expand(3, -1)), dim=1)

    def embed_rows(self, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """The image embedding rows among sequence indices start..end-1: (index - start, rows)
        per image that overlaps them."""
        rows = []
        for ref, embeds in zip(self.refs, self.embeds, strict=True):
            lo, hi = max(start, ref.offset), min(end, ref.offset + ref.num_tokens)
            if lo < hi:
                rows.append((lo - start, embeds[lo - ref.offset:hi - ref.offset]))
        return rows


class ImagesMissing(ValueError):
    """Images named by key alone (their bytes went with an earlier request) whose embeddings
    this engine no longer holds: the caller sends them again, with their bytes."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)
        super().__init__("images not held here, send their png: "
                         + ", ".join(key[:12] for key in self.keys))


class ImageEncoder:
    def __init__(self, model: Qwen2VLForCausalLM, settings: ImageSettings,
                 capacity: int = 256) -> None:
        self.model = model
        self.settings = settings
        self.capacity = capacity
        self._embeds: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.images_encoded = 0  # vision tower runs (one per image not already cached)
        self.images_seen = 0

    def prompt(self, prompt_ids: Sequence[int],
               images: Sequence[tuple[ImageRef, bytes | None]]) -> PromptImages:
        """Check the images against the prompt's pad runs and encode the ones not cached; a
        ValueError naming the image when a ref and the prompt or its pixels disagree, and
        :class:`ImagesMissing` when an image without bytes (None: named by key alone) is not
        cached."""
        config = self.model.config
        refs = tuple(sorted((ref for ref, _ in images), key=lambda ref: ref.offset))
        data = {ref.key: png for ref, png in images}
        for ref in refs:
            span = prompt_ids[ref.offset:ref.offset + ref.num_tokens]
            if ref.offset < 1 or len(span) != ref.num_tokens or \
                    any(t != config.image_token_id for t in span):
                raise ValueError(f"image {ref.key[:12]}: tokens {ref.offset}.."
                                 f"{ref.offset + ref.num_tokens} of the prompt are not its "
                                 f"image-pad tokens")
        missing = [ref.key for ref in refs if data[ref.key] is None and ref.key not in self._embeds]
        if missing:
            raise ImagesMissing(missing)
        embeds = tuple(self._encode(ref, data[ref.key]) for ref in refs)
        positions, delta = span_positions(len(prompt_ids), [(r.offset, r.grid) for r in refs],
                                          config.vision.spatial_merge_size)
        return PromptImages(refs, embeds, positions, delta)

    def forget(self) -> None:
        """Drop every cached embedding (the vision tower's weights changed)."""
        self._embeds.clear()

    def _encode(self, ref: ImageRef, png: bytes | None) -> torch.Tensor:
        self.images_seen += 1
        cached = self._embeds.get(ref.key)
        if cached is not None:
            self._embeds.move_to_end(ref.key)
            return cached
        assert png is not None  # prompt() checked: an uncached image came with its bytes
        image = preprocess_image(png, self.settings)
        if image.digest != ref.key or tuple(image.grid) != tuple(ref.grid) or \
                image.num_tokens != ref.num_tokens:
            raise ValueError(f"image {ref.key[:12]}: its pixels give hash "
                             f"{image.digest[:12]}, grid {tuple(image.grid)} and "
                             f"{image.num_tokens} tokens, not the ref's grid "
                             f"{tuple(ref.grid)} and {ref.num_tokens} tokens")
        model = self.model
        with torch.inference_mode():
            embeds = model.encode_images(image.pixel_values.to(model.device, model.dtype),
                                         [image.grid])
        self.images_encoded += 1
        self._embeds[ref.key] = embeds
        while len(self._embeds) > self.capacity:
            self._embeds.popitem(last=False)
        return embeds

