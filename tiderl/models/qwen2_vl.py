"""Qwen2-VL and Qwen2.5-VL in plain PyTorch: the Qwen2 decoder of :mod:`.qwen2` with a vision
tower (:mod:`.vision`) and multimodal rotary positions (mrope).

    image -> vision_inputs.preprocess_image -> pixel_values, grid (t, h, w)
          -> Qwen2VLForCausalLM.encode_images -> image_embeds [num_image_tokens, hidden]
    input_ids (text ... <|vision_start|> <|image_pad|> x n <|vision_end|> ... text)
          -> embed_tokens, the image_pad rows replaced by image_embeds in order
          -> the Qwen2 layers with mrope positions [3, ...] -> norm -> lm_head

The language part has the text model's layout (``model.embed_tokens``, ``model.layers[i]``,
``model.norm``, ``lm_head``; the same :class:`~tiderl.models.qwen2.DecoderLayer`), plus
``visual``; parameter names are the hub checkpoints' (``visual.*`` beside ``model.*``).

Positions (:func:`mrope_positions`): every token has three, (temporal, height, width). A text
token's three are equal, and count on from the token before; an image's tokens take the
(frame, row, column) of their merged patch, offset by the position where the image starts;
the text after an image continues at the image's largest position + 1. The rotary frequency
pairs are split into ``mrope_section`` (summing to head_dim / 2): the first section turns with
the temporal position, the second with the height, the third with the width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from tiderl.models.attention import PagedBatch
from tiderl.models.config import VL_MODEL_TYPES
from tiderl.models.qwen2 import (
    Attention,
    DecoderLM,
    Qwen2Config,
    Qwen2Model,
    Rotary,
    text_fields,
)
from tiderl.models.vision import Grid, VisionConfig, VisionTower, grid_list
from tiderl.models.vision_inputs import ImageSettings

ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                 "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


@dataclass(frozen=True)
class Qwen2VLConfig(Qwen2Config):
    """A Qwen2 language model's config (the inherited fields) with the vision part:
    ``mrope_section`` (three sizes summing to head_dim / 2), the three token ids that frame an
    image in the text, and the vision tower's config (its ``kind`` is the ``model_type``)."""

    mrope_section: tuple[int, int, int] = (16, 24, 24)
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    vision: VisionConfig = field(default_factory=VisionConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must be three sizes "
                             f"summing to head_dim / 2 = {self.head_dim // 2}")
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"the vision tower's output ({self.vision.out_hidden_size}) must "
                             f"be the hidden size ({self.hidden_size})")

    @property
    def model_type(self) -> str:
        return self.vision.kind

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> Qwen2VLConfig:
        """Read an HF ``config.json`` dict of a ``qwen2_vl`` or ``qwen2_5_vl`` model: the
        language fields nested in ``text_config`` (transformers 5) or flat (the hub's),
        ``rope_scaling`` / ``rope_parameters`` with the ``mrope_section``."""
        kind = data.get("model_type")
        if kind not in VL_MODEL_TYPES:
            raise ValueError(f"model_type {kind!r} is not one of {', '.join(VL_MODEL_TYPES)}")
        text = {**data, **(data.get("text_config") or {})}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if "mrope_section" not in rope:
            raise ValueError("no mrope_section in rope_scaling / rope_parameters")
        fields = text_fields(text, rope_types=("default", "mrope"))
        fields["tie_word_embeddings"] = bool(data.get("tie_word_embeddings")
                                             or text.get("tie_word_embeddings"))
        return cls(**fields, mrope_section=tuple(rope["mrope_section"]),
                   image_token_id=data.get("image_token_id", 151655),
                   vision_start_token_id=data.get("vision_start_token_id", 151652),
                   vision_end_token_id=data.get("vision_end_token_id", 151653),
                   vision=VisionConfig.from_hf(data["vision_config"], kind))

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers reads as this model (its language part nested
        in ``text_config``, as transformers 5 writes it)."""
        text = {k: v for k, v in asdict(self).items()
                if k not in ("mrope_section", "image_token_id", "vision_start_token_id",
                             "vision_end_token_id", "vision", "rope_theta", "torch_dtype",
                             "tie_word_embeddings")}
        text |= {"model_type": f"{self.model_type}_text", "hidden_act": "silu",
                 "attention_dropout": 0.0, "use_sliding_window": False, "use_cache": True,
                 "initializer_range": 0.02,
                 "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                     "mrope_section": list(self.mrope_section)}}
        return {"architectures": [ARCHITECTURES[self.model_type]],
                "model_type": self.model_type, "torch_dtype": self.torch_dtype,
                "tie_word_embeddings": self.tie_word_embeddings,
                "image_token_id": self.image_token_id,
                "vision_start_token_id": self.vision_start_token_id,
                "vision_end_token_id": self.vision_end_token_id,
                "text_config": text, "vision_config": self.vision.to_hf()}


class MRotary(Rotary):
    """Multimodal rotary: positions [3, ..., T] (temporal, height, width), frequency pairs
    split by ``mrope_section``; plain positions [..., T] rotate as :class:`Rotary` does (the
    three components equal, as for text)."""

    def __init__(self, head_dim: int, theta: float, mrope_section: Sequence[int]):
        super().__init__(head_dim, theta)
        self.mrope_section = tuple(mrope_section)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, D]; positions [3, ..., T] or [..., T] -> rotated x."""
        if positions.dim() == x.dim() - 2:
            return super().forward(x, positions)
        exponents = torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        component = torch.repeat_interleave(torch.arange(3, device=x.device),
                                            torch.tensor(self.mrope_section, device=x.device))
        # [..., T, D/2]: frequency pair j turns with component[j] of the position
        freqs = positions.float().movedim(0, -1)[..., component] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)  # [..., T, 1, D]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def mrope_positions(input_ids: Sequence[int] | torch.Tensor,
                    image_grid_thw: Sequence[Grid] | torch.Tensor,
                    config: Qwen2VLConfig) -> tuple[torch.Tensor, int]:
    """The mrope positions [3, T] (int64) of one sequence, and its ``delta``.

    ``image_grid_thw``: the (t, h, w) patch grid of each image whose ``image_token_id`` run is in
    ``input_ids``, in order (``t * h * w / merge^2`` tokens each). Equal to transformers'
    ``get_rope_index`` for images.

    ``delta`` = largest position + 1 - T. A token appended at sequence index i >= T (decoding,
    or text of a later turn) has position ``i + delta`` in all three components; for such text
    tokens the three are equal, so plain 1-D rotary at position ``i + delta`` turns them exactly
    as mrope does. Positions of a prefix do not depend on what follows it: a sequence that grows
    turn by turn (a new image included) can take the new tokens' slice of the whole sequence's
    positions.
    """
    ids = torch.as_tensor(input_ids).tolist()
    unit = config.vision.spatial_merge_size ** 2
    grids, spans, i = list(grid_list(image_grid_thw)), [], 0
    for t, h, w in grids:
        i = next((j for j in range(i, len(ids)) if ids[j] == config.image_token_id), len(ids))
        count = t * h * w // unit
        if count == 0 or ids[i:i + count] != [config.image_token_id] * count:
            raise ValueError(f"the image tokens at index {i} do not match the image grids "
                             f"{list(image_grid_thw)}")
        spans.append((i, (t, h, w)))
        i += count
    if config.image_token_id in ids[i:]:
        raise ValueError(f"more image token runs than image grids {list(image_grid_thw)}")
    return span_positions(len(ids), spans, config.vision.spatial_merge_size)


def span_positions(length: int, spans: Sequence[tuple[int, Grid]], merge: int
                   ) -> tuple[torch.Tensor, int]:
    """:func:`mrope_positions` of a sequence of ``length`` tokens whose images are the runs
    that start at the given offsets, with the given grids, in order; every other token is text,
    whatever its id (a model may sample the image-pad token itself: it is text there)."""
    parts, start, at = [], 0, 0
    for offset, (t, h, w) in spans:
        h, w = h // merge, w // merge
        parts.append(torch.arange(start, start + offset - at).expand(3, -1))
        start += offset - at
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                          indexing="ij")).reshape(3, -1)
        parts.append(grid + start)
        start += max(h, w)
        at = offset + t * h * w
    parts.append(torch.arange(start, start + length - at).expand(3, -1))
    positions = torch.cat(parts, dim=1)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


VISION_PREFIX = "visual."  # the vision tower's parameter names (as in HF Qwen2-VL folders)


class Qwen2VLForCausalLM(DecoderLM):
    """Qwen2-VL / Qwen2.5-VL. The language part is :class:`~tiderl.models.qwen2.Qwen2Model`
    (so the engine's runner and the trainer treat it as the text model's); ``visual`` is the
    vision tower. Images enter as ``image_embeds`` (from :meth:`encode_images`) or as
    ``pixel_values`` with their ``image_grid_thw``; each embedding row replaces one
    ``image_token_id`` token of ``input_ids``, in order.

    ``image_settings``: how images are cut for this model
    (:func:`~tiderl.models.vision_inputs.preprocess_image`): the defaults with the tower's patch
    sizes, or the folder's ``preprocessor_config.json`` when
    :func:`~tiderl.models.loading.load_model` built it."""

    def __init__(self, config: Qwen2VLConfig):
        super().__init__()
        self.config = config
        self.image_settings = ImageSettings.for_vision(config.vision)
        rotary = MRotary(config.head_dim, config.rope_theta, config.mrope_section)
        self.model = Qwen2Model(config, rotary)
        self.visual = VisionTower(config.vision)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def freeze_vision(self, frozen: bool = True) -> None:
        """Stop (or restart) training the whole vision tower, merger included: its parameters
        get ``requires_grad = not frozen``; the images' embeddings still flow into the LLM."""
        self.visual.requires_grad_(not frozen)

    def encode_images(self, pixel_values: torch.Tensor,
                      image_grid_thw: Sequence[Grid] | torch.Tensor) -> torch.Tensor:
        """pixel_values [num_patches, C * t * p * p] of the images ``image_grid_thw`` (each
        image's patches in turn, :func:`~tiderl.models.vision_inputs.preprocess_image`) ->
        [num_image_tokens, hidden]: each image's LLM tokens in order."""
        return self.visual(pixel_values.to(self.device), grid_list(image_grid_thw))

    def embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None,
              image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings [..., hidden], the image tokens' rows replaced by ``image_embeds``
        [num_image_tokens, hidden] in order: the ``image_rows`` (indices into the flattened
        input_ids) when given, else every ``image_token_id`` token (their counts must match)."""
        x = self.model.embed_tokens(input_ids)
        given = 0 if image_embeds is None else len(image_embeds)
        if image_rows is not None:
            if len(image_rows) != given:
                raise ValueError(f"{len(image_rows)} image rows but {given} image embeddings")
            if not given:
                return x
            flat = x.reshape(-1, x.shape[-1]).index_copy(0, image_rows, image_embeds.to(x.dtype))
            return flat.view_as(x)
        is_image = input_ids == self.config.image_token_id
        count = int(is_image.sum())
        if count != given:
            raise ValueError(f"{count} image tokens in input_ids but {given} image embeddings")
        if not count:
            return x
        return x.masked_scatter(is_image.unsqueeze(-1), image_embeds.to(x.dtype))

    def _image_embeds(self, image_embeds: torch.Tensor | None,
                      pixel_values: torch.Tensor | None,
                      image_grid_thw: Sequence[Grid] | torch.Tensor | None) -> torch.Tensor | None:
        if pixel_values is None:
            return image_embeds
        if image_embeds is not None or image_grid_thw is None:
            raise ValueError("pixel_values need image_grid_thw, and replace image_embeds")
        return self.encode_images(pixel_values, image_grid_thw)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                image_embeds: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None,
                image_grid_thw: Sequence[Grid] | torch.Tensor | None = None,
                cu_seqlens: list[int] | None = None, targets: torch.Tensor | None = None,
                target_rows: torch.Tensor | None = None,
                chunk_tokens: int = 1024, image_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """:meth:`Qwen2ForCausalLM.forward <tiderl.models.qwen2.Qwen2ForCausalLM.forward>`
        with images: dense input_ids [B, T] -> logits [B, T, vocab]; packed (``cu_seqlens``)
        input_ids [N] -> logits [N, vocab], or with ``targets`` and ``target_rows`` the [M]
        float32 log-probabilities of the targets, computed ``chunk_tokens`` rows at a time.

        ``positions``: mrope [3, B, T] / [3, N], or plain [B, T] / [N] (the three components
        equal). Dense, it defaults to :func:`mrope_positions` of each row (``image_grid_thw``
        then lists every row's images, row after row), or 0..T-1 without images; packed, it
        is required (each sequence's positions from its own start).

        Images: ``image_embeds`` [num_image_tokens, hidden] (:meth:`encode_images`), or
        ``pixel_values`` with ``image_grid_thw`` (the tower runs inside this call, and trains
        unless frozen: :meth:`freeze_vision`). Rows fill the ``image_token_id`` tokens of
        input_ids in order, row-major, or the ``image_rows`` (flat indices) when given: a
        sequence may hold image-pad tokens the model sampled, which are text.
        """
        image_embeds = self._image_embeds(image_embeds, pixel_values, image_grid_thw)
        x = self.embed(input_ids, image_embeds, image_rows)
        if cu_seqlens is None and positions is None:
            if image_grid_thw is not None:
                positions = self._dense_positions(input_ids, image_grid_thw)
            elif image_embeds is not None and len(image_embeds):
                raise ValueError("the positions of images need their image_grid_thw")
            else:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
                positions = positions.expand_as(input_ids)
        assert positions is not None, "a packed forward needs each token's position"
        return self._decode(x, positions, cu_seqlens, targets, target_rows, chunk_tokens)

    def _dense_positions(self, input_ids: torch.Tensor,
                         image_grid_thw: Sequence[Grid] | torch.Tensor) -> torch.Tensor:
        """[3, B, T]: each row's :func:`mrope_positions`, its images taken from
        ``image_grid_thw`` in turn."""
        grids = grid_list(image_grid_thw)
        unit = self.config.vision.merge_unit
        rows = []
        for row in input_ids:
            need = int((row == self.config.image_token_id).sum())
            mine = []
            while need > 0 and grids:
                t, h, w = grids.pop(0)
                mine.append((t, h, w))
                need -= t * h * w // unit
            rows.append(mrope_positions(row, mine, self.config)[0])
        return torch.stack(rows, dim=1).to(input_ids.device)

    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: torch.Tensor, batch: PagedBatch,
                      logits_indices: torch.Tensor | None = None,
                      image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`Qwen2ForCausalLM.forward_paged
        <tiderl.models.qwen2.Qwen2ForCausalLM.forward_paged>` with images: packed new tokens
        input_ids [N] -> logits [N, vocab] (or the rows ``logits_indices``), this step's keys
        and values written into ``kv_cache``.

        ``positions``: the rotary positions, mrope [3, N] or plain [N] (a decode token at
        sequence index i: ``i + delta``, :func:`mrope_positions`). Where each token sits in its
        sequence's cache comes from ``batch`` (its context length less its new tokens, counted
        on), not from ``positions``. ``image_embeds``: the rows of the image tokens among
        these new tokens, in order (an image's tokens all in the same step's chunk or split
        across chunks, each chunk given its own rows)."""
        x = self.embed(input_ids, image_embeds)
        rotary = self.model.rotary
        places = cache_positions(batch, len(input_ids))

        def attend(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            return attn.forward_paged(h, positions, rotary, kv_cache, batch, places)

        hidden = self.model.run_layers(x, attend)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.lm_head(hidden)


def cache_positions(batch: PagedBatch, num_tokens: int) -> torch.Tensor:
    """[num_tokens]: each new token's place in its sequence's cache (the new tokens are the
    last of each sequence's context)."""
    starts = batch.query_start_loc
    counts = starts.diff()
    seq = torch.repeat_interleave(torch.arange(len(counts), device=starts.device), counts)
    first = batch.context_lens - counts  # cache place of each sequence's first new token
    return torch.arange(num_tokens, device=starts.device) - starts[seq] + first[seq]
