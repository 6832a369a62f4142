"""What a weight sync carries: after each update the actor's weights (and, for a new actor, its
AdamW state) go to the ranks that need them, through :mod:`tiderl.trainer.weight_feed`.

Both sides agree on what is sent through a *layout*, the sorted ``(name, shape, dtype)`` list
that each receiver builds from its own model, so nothing but the tensor bytes crosses the wire:
the layout is cut into *buckets* (one dtype each, at most ``bucket_bytes``), each sent as one flat
buffer, and a receiver's tensors are views of those buffers under the HF names. A layout's hash
makes a mismatch between the two sides an error instead of garbage.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from tiderl.models.qwen2 import Qwen2ForCausalLM

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]
DEFAULT_BUCKET_BYTES = 64 << 20
TIED_NAME = "lm_head.weight"


@dataclass(frozen=True)
class Bucket:
    """Consecutive layout entries of one dtype sent as one flat buffer."""

    dtype: torch.dtype
    entries: tuple[tuple[str, tuple[int, ...], int], ...]  # name, shape, offset (elements)
    numel: int


def param_layout(model: Qwen2ForCausalLM) -> Layout:
    """What a sync of ``model``'s weights carries: every state-dict entry sorted by name, except
    a tied ``lm_head.weight`` (it is the embedding, which is sent once)."""
    state = model.state_dict(keep_vars=True)
    embed = state.get("model.embed_tokens.weight")
    tied = model.config.tie_word_embeddings and state.get(TIED_NAME) is embed
    return [(name, tuple(t.shape), t.dtype) for name, t in sorted(state.items())
            if not (tied and name == TIED_NAME)]


def state_layout(state: dict[str, torch.Tensor]) -> Layout:
    """The layout of a plain state dict (all entries, sorted by name)."""
    return [(name, tuple(t.shape), t.dtype) for name, t in sorted(state.items())]


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy synced weights into ``model`` in place, cast to its dtypes. ``state`` may hold any
    subset of its state dict: a sync leaves out a tied ``lm_head.weight`` (the embedding)."""
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def plan_buckets(layout: Layout, bucket_bytes: int) -> list[Bucket]:
    """Group the layout by dtype (first-appearance order, layout order within a dtype) and fill
    buckets of at most ``bucket_bytes``; a larger tensor, or every tensor when ``bucket_bytes``
    is 0, gets a bucket of its own (sent without a copy) while the open bucket keeps filling, so
    small tensors between big ones still travel together. Every rank computes the same plan."""
    by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape, dtype in layout:
        by_dtype.setdefault(dtype, []).append((name, shape))
    buckets: list[Bucket] = []
    for dtype, items in by_dtype.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        entries: list[tuple[str, tuple[int, ...], int]] = []
        numel = 0
        for name, shape in items:
            size = math.prod(shape)
            if size * itemsize > bucket_bytes:
                buckets.append(Bucket(dtype, ((name, shape, 0),), size))
                continue
            if (numel + size) * itemsize > bucket_bytes:
                buckets.append(Bucket(dtype, tuple(entries), numel))
                entries, numel = [], 0
            entries.append((name, shape, numel))
            numel += size
        if entries:
            buckets.append(Bucket(dtype, tuple(entries), numel))
    return buckets


def layout_hash(layout: Layout) -> int:
    """A process-independent 62-bit hash of the layout (Python's ``hash`` is salted per
    process)."""
    text = repr([(name, shape, str(dtype)) for name, shape, dtype in layout])
    return (int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2) | 1


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: flat[offset:offset + math.prod(shape)].view(shape)
            for name, shape, offset in bucket.entries}
