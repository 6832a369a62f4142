"""Images to model inputs for Qwen2-VL / Qwen2.5-VL, as transformers' image processor makes them.

    PNG bytes or an H x W x 3 uint8 array
      -> RGB (transparency composited onto white)
      -> resized (PIL bicubic) to the nearest size whose sides are multiples of
         patch * merge and whose area lies within [min_pixels, max_pixels] (:func:`smart_resize`)
      -> x / 255, then (x - mean) / std per channel (CLIP's mean and std), float32
      -> patches: the image repeated ``temporal_patch_size`` times (a still image is a clip of
         identical frames), cut into patch x patch squares, ordered merge block by merge block
         (row-major over blocks, row-major inside), each flattened as (channel, frame, row, col)
      => pixel_values [h * w, C * temporal * patch * patch], grid (1, h, w) in patches,
         h * w / merge^2 LLM tokens.

The result equals ``Qwen2VLImageProcessorPil`` (transformers' PIL backend, the one that runs
without torchvision; ``tests/unit/test_qwen2_vl.py`` compares them). Its torchvision backend
resizes with torch's bicubic, which differs from PIL's by rounding.

In the text, an image is ``<|vision_start|>``, ``<|image_pad|>`` once per LLM token, then
``<|vision_end|>`` (:func:`image_placeholder_ids`). :func:`image_digest` names an image by its
content, so that a cache can hold its preprocessed patches or embeddings by reference.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from tiderl.models.vision import Grid, VisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"
MAX_ASPECT_RATIO = 200


class VisionModelConfig(Protocol):
    """What this module reads of a vision model's config: a
    :class:`~tiderl.models.qwen2_vl.Qwen2VLConfig` (a protocol, since the model module imports
    this one)."""

    @property
    def vision(self) -> VisionConfig: ...

    @property
    def image_token_id(self) -> int: ...

    @property
    def vision_start_token_id(self) -> int: ...

    @property
    def vision_end_token_id(self) -> int: ...


@dataclass(frozen=True)
class ImageSettings:
    """How images are cut for a model: its patch sizes and the pixel budget per image (the
    defaults are transformers' ``Qwen2VLImageProcessor`` defaults)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} and max_pixels {self.max_pixels}: "
                             "need 0 < min_pixels <= max_pixels")

    @classmethod
    def for_vision(cls, vision: VisionConfig) -> ImageSettings:
        """The defaults, with the patch sizes of the vision tower ``vision``."""
        return cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                   merge_size=vision.spatial_merge_size)

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> ImageSettings:
        """Read a ``preprocessor_config.json`` dict: ``min_pixels`` / ``max_pixels`` (the hub's
        spelling) win over ``size.shortest_edge`` / ``size.longest_edge`` (transformers 5's)."""
        size = data.get("size") or {}
        default = cls()
        return cls(
            patch_size=data.get("patch_size", default.patch_size),
            temporal_patch_size=data.get("temporal_patch_size", default.temporal_patch_size),
            merge_size=data.get("merge_size", default.merge_size),
            min_pixels=data.get("min_pixels") or size.get("shortest_edge") or default.min_pixels,
            max_pixels=data.get("max_pixels") or size.get("longest_edge") or default.max_pixels,
            image_mean=tuple(data.get("image_mean", CLIP_MEAN)),
            image_std=tuple(data.get("image_std", CLIP_STD)))

    def to_hf(self) -> dict[str, Any]:
        """The ``preprocessor_config.json`` transformers reads as a ``Qwen2VLImageProcessor``."""
        return {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True,
                "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": True, "do_convert_rgb": True,
                "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "min_pixels": self.min_pixels,
                "max_pixels": self.max_pixels,
                "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}}


def image_settings(folder: str | Path | None, config: VisionModelConfig) -> ImageSettings:
    """The folder's ``preprocessor_config.json`` settings, or the defaults with the model's
    patch sizes when it has none (or there is no folder: a model made in memory); a ValueError
    naming the file when it cannot be read."""
    file = Path(folder) / PREPROCESSOR_FILE if folder else None
    if file is not None and file.is_file():
        try:
            return ImageSettings.from_hf(json.loads(file.read_text()))
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{file}: {exc}") from None
    return ImageSettings.for_vision(config.vision)


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: ``pixel_values`` [num_patches, C * temporal * patch * patch]
    float32, ``grid`` (t, h, w) in patches, ``num_tokens`` its LLM tokens, ``digest`` its
    :func:`image_digest`."""

    pixel_values: torch.Tensor
    grid: Grid
    num_tokens: int
    digest: str


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """The (height, width) an image is resized to: each side rounded to a multiple of
    ``factor`` (half to even), then, if the area is out of [min_pixels, max_pixels], both
    sides scaled by one factor (rounded down when shrinking, up when growing) to bring it in.
    A ValueError for an aspect ratio over 200."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise ValueError(f"image {width}x{height}: aspect ratio over {MAX_ASPECT_RATIO}")
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    if new_h * new_w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / scale / factor) * factor)
        new_w = max(factor, math.floor(width / scale / factor) * factor)
    elif new_h * new_w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * scale / factor) * factor
        new_w = math.ceil(width * scale / factor) * factor
    return new_h, new_w


def preprocess_image(image: bytes | np.ndarray, settings: ImageSettings = ImageSettings()
                     ) -> ImageInput:
    """One image (PNG or any format Pillow reads, as bytes; or an H x W x 3 uint8 array) ->
    its :class:`ImageInput`, as described above."""
    from PIL import Image  # Pillow: a dependency of matplotlib

    picture = _rgb(image)
    height, width = resized_size(picture.height, picture.width, settings)
    resized = np.asarray(picture.resize((width, height), Image.Resampling.BICUBIC))
    scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.array(settings.image_mean, dtype=np.float32)
    std = np.array(settings.image_std, dtype=np.float32)
    pixels = (scaled - mean) / std  # [H, W, C]
    patches, grid_h, grid_w = _patchify(pixels, settings)
    tokens = grid_h * grid_w // settings.merge_size ** 2
    return ImageInput(torch.from_numpy(patches), (1, grid_h, grid_w), tokens,
                      image_digest(image))


def resized_size(height: int, width: int, settings: ImageSettings) -> tuple[int, int]:
    """The (height, width) ``settings`` resize an image of this size to (:func:`smart_resize`
    to whole merged patches within the pixel budget)."""
    return smart_resize(height, width, settings.patch_size * settings.merge_size,
                        settings.min_pixels, settings.max_pixels)


def image_grid(height: int, width: int, settings: ImageSettings) -> tuple[Grid, int]:
    """The (t, h, w) patch grid and the LLM tokens of an image of this size, as
    :func:`preprocess_image` gives them, without decoding its pixels."""
    height, width = resized_size(height, width, settings)
    grid_h, grid_w = height // settings.patch_size, width // settings.patch_size
    return (1, grid_h, grid_w), grid_h * grid_w // settings.merge_size ** 2


def _rgb(image: bytes | np.ndarray):
    """A PIL RGB image: bytes decoded, transparency composited onto white."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"an image array must be H x W x 3 uint8, got {image.shape} "
                             f"{image.dtype}")
        return Image.fromarray(image, "RGB")
    picture = Image.open(io.BytesIO(image))
    if "A" in picture.getbands() or picture.info.get("transparency") is not None:
        white = Image.new("RGBA", picture.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, picture.convert("RGBA")).convert("RGB")
    return picture.convert("RGB")


def _patchify(pixels: np.ndarray, settings: ImageSettings) -> tuple[np.ndarray, int, int]:
    """[H, W, C] -> patches [h * w, C * temporal * patch * patch] in merge-block order, and
    the grid (h, w) in patches."""
    patch, merge, frames = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    height, width, channels = pixels.shape
    grid_h, grid_w = height // patch, width // patch
    blocks = pixels.reshape(grid_h // merge, merge, patch, grid_w // merge, merge, patch,
                            channels)
    # -> (block row, block col, row in block, col in block, channel, pixel row, pixel col)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
    clip = np.broadcast_to(blocks[:, :, :, :, :, None],
                           (*blocks.shape[:5], frames, patch, patch))
    flat = clip.reshape(grid_h * grid_w, channels * frames * patch * patch)
    return np.ascontiguousarray(flat), grid_h, grid_w


def batch_images(images: Sequence[ImageInput]) -> tuple[torch.Tensor, list[Grid]]:
    """The ``pixel_values`` of several images back to back and their grids, in order, as
    :meth:`Qwen2VLForCausalLM.encode_images
    <tiderl.models.qwen2_vl.Qwen2VLForCausalLM.encode_images>` takes them."""
    return torch.cat([i.pixel_values for i in images]), [i.grid for i in images]


def image_placeholder_ids(num_tokens: int, config: VisionModelConfig) -> list[int]:
    """An image's ids in the text: vision_start, ``num_tokens`` x image_pad, vision_end."""
    return [config.vision_start_token_id, *[config.image_token_id] * num_tokens,
            config.vision_end_token_id]


def image_digest(image: bytes | np.ndarray) -> str:
    """sha256 hex of an image's content: of the bytes as given, or of an array's shape, dtype
    and bytes. (The same picture as PNG bytes and as an array has two digests.)"""
    if isinstance(image, np.ndarray):
        header = f"{image.shape}{image.dtype}".encode()
        return hashlib.sha256(header + np.ascontiguousarray(image).tobytes()).hexdigest()
    return hashlib.sha256(image).hexdigest()
