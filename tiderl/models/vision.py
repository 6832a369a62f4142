"""The vision tower of Qwen2-VL and Qwen2.5-VL in plain PyTorch: image patches in, one embedding
per LLM image token out.

    pixel_values [num_patches, C * temporal_patch * patch * patch]   (:mod:`.vision_inputs`)
      -> Conv3d patch embedding (no bias)                 [num_patches, width]
      -> ``depth`` blocks: attention within one image (Qwen2.5-VL: within one window, except
         the ``fullatt_block_indexes`` blocks), 2-D rotary on each patch's (row, column)
      -> PatchMerger: norm, the ``merge x merge`` neighbouring patches concatenated, a 2-layer
         GELU MLP                                          [num_patches / merge^2, out_hidden]

The patches of an image come in the image processor's order: ``merge x merge`` blocks one after
another (row-major over blocks, row-major inside a block), so each merged token's patches are
consecutive rows. The two variants:

- ``qwen2_vl``: LayerNorm blocks (with bias), QuickGELU MLP (fc1, fc2), LayerNorm merger.
- ``qwen2_5_vl``: RMSNorm blocks, SwiGLU MLP with biases (gate, up, down), RMSNorm merger, and
  window attention: the merged tokens of an image are regrouped into windows of
  ``window_size / (patch * merge)`` merged tokens a side (windows row-major, tokens row-major
  inside), the blocks run in that order, and the merger's outputs are put back.

Parameter names are those of the HF checkpoints under ``visual.``. The numerics follow
transformers' (rotary in float32, norms as the text model's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tiderl.models.qwen2 import RMSNorm

VISION_KINDS = ("qwen2_vl", "qwen2_5_vl")
ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

Grid = tuple[int, int, int]  # (t, h, w) of one image, in patches


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's hyperparameters. ``kind``: ``qwen2_vl`` or ``qwen2_5_vl`` (the block
    and merger layout above); ``width``: the tower's hidden size (HF ``embed_dim`` of Qwen2-VL,
    ``hidden_size`` of Qwen2.5-VL); ``out_hidden_size``: the merger's output, the LLM's hidden
    size (HF ``hidden_size`` of Qwen2-VL, ``out_hidden_size`` of Qwen2.5-VL)."""

    kind: str = "qwen2_vl"
    depth: int = 32
    width: int = 1280
    num_heads: int = 16
    intermediate_size: int = 5120
    out_hidden_size: int = 3584
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # qwen2_5_vl only, in pixels
    fullatt_block_indexes: tuple[int, ...] = ()  # qwen2_5_vl only
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.kind not in VISION_KINDS:
            raise ValueError(f"vision kind {self.kind!r} (known: {', '.join(VISION_KINDS)})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}")
        if self.width % self.num_heads or (self.width // self.num_heads) % 4:
            raise ValueError("vision width / num_heads must be a multiple of 4 (2-D rotary)")
        if self.kind == "qwen2_vl" and self.intermediate_size % self.width:
            raise ValueError("a qwen2_vl tower's intermediate_size must be a multiple of its "
                             "width (HF mlp_ratio)")
        if self.kind == "qwen2_5_vl" and self.window_size % (self.patch_size
                                                              * self.spatial_merge_size):
            raise ValueError("window_size must be a multiple of patch_size * spatial_merge_size")

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches per LLM token."""
        return self.spatial_merge_size ** 2

    @classmethod
    def from_hf(cls, data: dict[str, Any], kind: str) -> VisionConfig:
        """Read an HF ``vision_config`` dict of a ``kind`` model (hub and transformers-5
        spellings: ``in_chans`` or ``in_channels``, ``rope_theta`` or ``rope_parameters``)."""
        rope = data.get("rope_parameters") or {}
        common = dict(
            kind=kind, depth=data["depth"], num_heads=data["num_heads"],
            in_channels=data.get("in_channels", data.get("in_chans", 3)),
            patch_size=data.get("patch_size", 14),
            temporal_patch_size=data.get("temporal_patch_size", 2),
            spatial_merge_size=data.get("spatial_merge_size", 2),
            rope_theta=rope.get("rope_theta", data.get("rope_theta", 10000.0)))
        if kind == "qwen2_vl":
            width = data["embed_dim"]
            return cls(**common, width=width,
                       intermediate_size=int(width * data.get("mlp_ratio", 4)),
                       out_hidden_size=data["hidden_size"],
                       hidden_act=data.get("hidden_act", "quick_gelu"))
        return cls(**common, width=data["hidden_size"],
                   intermediate_size=data["intermediate_size"],
                   out_hidden_size=data["out_hidden_size"],
                   hidden_act=data.get("hidden_act", "silu"),
                   window_size=data.get("window_size", 112),
                   fullatt_block_indexes=tuple(data.get("fullatt_block_indexes", ())))

    def to_hf(self) -> dict[str, Any]:
        """The ``vision_config`` dict transformers reads for this kind."""
        common = {"depth": self.depth, "num_heads": self.num_heads,
                  "in_channels": self.in_channels, "patch_size": self.patch_size,
                  "temporal_patch_size": self.temporal_patch_size,
                  "spatial_merge_size": self.spatial_merge_size,
                  "hidden_act": self.hidden_act, "initializer_range": 0.02,
                  "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}
        if self.kind == "qwen2_vl":
            return {**common, "model_type": "qwen2_vl_vision", "embed_dim": self.width,
                    "mlp_ratio": self.intermediate_size // self.width,
                    "hidden_size": self.out_hidden_size}
        return {**common, "model_type": "qwen2_5_vl_vision", "hidden_size": self.width,
                "intermediate_size": self.intermediate_size,
                "out_hidden_size": self.out_hidden_size, "window_size": self.window_size,
                "fullatt_block_indexes": list(self.fullatt_block_indexes)}


def grid_list(grids: Sequence[Sequence[int]] | torch.Tensor) -> list[Grid]:
    """Image grids as (t, h, w) int tuples, from a [num_images, 3] tensor or a list."""
    return [(int(t), int(h), int(w)) for t, h, w in grids]


def patch_coordinates(grids: Sequence[Grid], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column [num_patches] of every patch of ``grids``, in the processor's patch
    order (merge blocks row-major, patches row-major inside a block; each frame alike)."""
    rows, cols = [], []
    for t, h, w in grids:
        block_row = torch.arange(h // merge).view(-1, 1, 1, 1) * merge
        block_col = torch.arange(w // merge).view(1, -1, 1, 1) * merge
        inner = torch.arange(merge)
        shape = (h // merge, w // merge, merge, merge)
        rows.append((block_row + inner.view(1, 1, -1, 1)).expand(shape).flatten().repeat(t))
        cols.append((block_col + inner.view(1, 1, 1, -1)).expand(shape).flatten().repeat(t))
    return torch.cat(rows), torch.cat(cols)


def frame_bounds(grids: Sequence[Grid]) -> list[int]:
    """Patch offsets where each frame of each image starts, and the total: attention runs
    within each frame."""
    bounds = [0]
    for t, h, w in grids:
        bounds.extend(bounds[-1] + h * w * (i + 1) for i in range(t))
    return bounds


def window_order(grids: Sequence[Grid], merge: int, window: int
                 ) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window regrouping: ``order`` [num_merged] lists the merged tokens window by
    window (``window`` merged tokens a side; windows row-major per frame, tokens row-major
    inside, edge windows smaller), and ``bounds`` are the patch offsets of the windows in that
    order (``merge^2`` patches per merged token)."""
    order, bounds, offset = [], [0], 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        ids = torch.arange(t * rows * cols).view(t, rows, cols) + offset
        padded = F.pad(ids, (0, -cols % window, 0, -rows % window), value=-1)
        tiles = padded.view(t, padded.shape[1] // window, window, padded.shape[2] // window,
                            window).permute(0, 1, 3, 2, 4).reshape(-1, window * window)
        order.append(tiles[tiles >= 0])
        for size in (tiles >= 0).sum(dim=1).tolist():
            bounds.append(bounds[-1] + size * merge * merge)
        offset += t * rows * cols
    return torch.cat(order), bounds


class VisionRotary(nn.Module):
    """2-D rotary: the first half of a head's frequency pairs turn with the patch's row, the
    second half with its column (the ``rotate_half`` layout, as transformers)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, rows: torch.Tensor, cols: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_patches, head_dim] float32."""
        quarter = self.head_dim // 2
        exponents = torch.arange(0, quarter, 2, device=rows.device).float() / quarter
        inv_freq = 1.0 / (self.theta ** exponents)
        half = torch.cat((rows.float().unsqueeze(-1) * inv_freq,
                          cols.float().unsqueeze(-1) * inv_freq), dim=-1)
        angles = torch.cat((half, half), dim=-1)
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated in float32 by cos, sin [N, D], back in x's dtype."""
    y = x.float()
    half = y.shape[-1] // 2
    turned = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return (y * cos.unsqueeze(1) + turned * sin.unsqueeze(1)).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=True)
        self.proj = nn.Linear(config.width, config.width, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                bounds: list[int]) -> torch.Tensor:
        """x [N, width]; each segment ``bounds[i]:bounds[i + 1]`` attends to itself only (no
        causal mask), one ``scaled_dot_product_attention`` call per segment."""
        q, k, v = self.qkv(x).view(len(x), 3, self.num_heads, -1).unbind(1)
        q, k = rotate(q, *rope), rotate(k, *rope)
        out = [F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))[0].transpose(0, 1)
            for a, b in pairwise(bounds)]
        return self.proj(torch.cat(out).reshape(x.shape))


class QuickGeluMLP(nn.Module):
    """Qwen2-VL's block MLP: fc1, activation, fc2."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.width, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.width)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's block MLP: SwiGLU with biases."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        width, inter = config.width, config.intermediate_size
        self.gate_proj = nn.Linear(width, inter)
        self.up_proj = nn.Linear(width, inter)
        self.down_proj = nn.Linear(inter, width)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: VisionConfig, size: int) -> nn.Module:
    if config.kind == "qwen2_vl":
        return nn.LayerNorm(size, eps=1e-6)
    return RMSNorm(size, 1e-6)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = _norm(config, config.width)
        self.norm2 = _norm(config, config.width)
        self.attn = VisionAttention(config)
        self.mlp = QuickGeluMLP(config) if config.kind == "qwen2_vl" else GatedMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each merged token's ``merge^2`` patches, 2-layer GELU MLP."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged = config.width * config.merge_unit
        self.ln_q = _norm(config, config.width)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_patches, width] -> [num_patches / merge^2, out_hidden_size]."""
        return self.mlp(self.ln_q(x).reshape(-1, self.merged))


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size,
                      config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.width, kernel_size=self.shape[1:],
                              stride=self.shape[1:], bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_patches, C * t * p * p] -> [num_patches, width] (the weights' dtype)."""
        patches = pixel_values.reshape(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(patches).flatten(1)


class VisionTower(nn.Module):
    """The whole tower (HF prefix ``visual.``)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values [num_patches, C * t * p * p] of the images ``grids`` (each image's
        patches in turn) -> [num_patches / merge^2, out_hidden_size]: each image's LLM tokens
        in order."""
        c = self.config
        if sum(t * h * w for t, h, w in grids) != len(pixel_values):
            raise ValueError(f"{len(pixel_values)} patches for image grids {list(grids)}")
        x = self.patch_embed(pixel_values)
        rows, cols = patch_coordinates(grids, c.spatial_merge_size)
        cos, sin = self.rotary(rows.to(x.device), cols.to(x.device))
        full = frame_bounds(grids)
        if c.kind == "qwen2_vl":
            for block in self.blocks:
                x = block(x, (cos, sin), full)
            return self.merger(x)
        order, windows = window_order(grids, c.spatial_merge_size,
                                      c.window_size // (c.patch_size * c.spatial_merge_size))
        order = order.to(x.device)
        x, cos, sin = (_regroup(t, order, c.merge_unit) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            x = block(x, (cos, sin), full if i in c.fullatt_block_indexes else windows)
        return self.merger(x)[torch.argsort(order)]


def _regroup(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """The rows of x [num_patches, ...] in groups of ``unit`` (one merged token), the groups
    taken in ``order``."""
    return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)
