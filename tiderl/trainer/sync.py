"""Weight sync: after each update the actor's weights go to the rollout ranks with their version.

One bucketed broadcast from the source rank (an actor rank holding the full state dict) to every
other rank of the group. Both sides agree on what is sent through a *layout*, the sorted
``(name, shape, dtype)`` list that each receiver builds from its own model, so nothing but the
tensor bytes crosses the wire::

    header  all_reduce(MAX) [version, layout hash, -layout hash]  (int64, 3 elements)
    bucket  broadcast(flat buffer)   x len(plan)   one dtype each, at most bucket_bytes,
                                                  up to MAX_IN_FLIGHT outstanding
            receiver: views of the flat buffer under the HF names (no copy beyond the buffer)

The header is an all-reduce rather than a broadcast so that every rank, the source too, learns
whether all layouts agree and raises together; a mismatch otherwise hangs or delivers garbage.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tiderl.models.qwen2 import Qwen2ForCausalLM

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]
DEFAULT_BUCKET_BYTES = 64 << 20
MAX_IN_FLIGHT = 2  # the source packs the next bucket while the previous one is on the wire
TIED_NAME = "lm_head.weight"


@dataclass(frozen=True)
class SyncResult:
    """The synced state (received tensors on receivers, the given dict on the source)."""

    state: dict[str, torch.Tensor]
    version: int
    num_bytes: int
    seconds: float
    gb_per_s: float


@dataclass(frozen=True)
class Bucket:
    """Consecutive layout entries of one dtype sent as one flat buffer."""

    dtype: torch.dtype
    entries: tuple[tuple[str, tuple[int, ...], int], ...]  # name, shape, offset (elements)
    numel: int


class LayoutMismatchError(RuntimeError):
    """The ranks of a sync passed different layouts."""


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
    """A process-independent, non-zero 62-bit hash of the layout (Python's ``hash`` is salted per
    process; 0 is the header's "the source state does not fit" sentinel)."""
    text = repr([(name, shape, str(dtype)) for name, shape, dtype in layout])
    return (int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2) | 1


def sync_params(state: dict[str, torch.Tensor] | None, names_shapes: Layout,
                version: int | None, *, src: int, group: dist.ProcessGroup | None = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                device: torch.device | None = None) -> SyncResult:
    """Broadcast the tensors named in ``names_shapes`` and ``version`` from global rank ``src``.

    On ``src``, ``state`` holds at least those tensors (extra entries are ignored; values are
    cast to the layout's dtype) and ``version`` >= 0; elsewhere both are None. Receivers get new
    tensors on ``device`` (default: CPU for gloo, the current CUDA device for NCCL), each a view
    of its bucket's buffer. Every rank of ``group`` must call this with the same layout.
    """
    is_src = dist.get_rank() == src
    if bucket_bytes < 0:
        raise ValueError(f"sync_params: bucket_bytes must be >= 0, got {bucket_bytes}")
    device = device or _group_device(group)
    start = time.perf_counter()
    problem = _check_source(state, version, names_shapes) if is_src else None
    version = _exchange_header(version if is_src else None, names_shapes, problem, device, group)
    received: dict[str, torch.Tensor] = {}
    num_bytes = 0
    in_flight: deque[dist.Work] = deque()
    for bucket in plan_buckets(names_shapes, bucket_bytes):
        if len(in_flight) == MAX_IN_FLIGHT:
            in_flight.popleft().wait()
        flat = _pack(bucket, state, device) if is_src else torch.empty(
            bucket.numel, dtype=bucket.dtype, device=device)
        in_flight.append(dist.broadcast(flat, src=src, group=group, async_op=True))
        num_bytes += flat.numel() * flat.element_size()
        if not is_src:
            received.update(_unpack(bucket, flat))
    for work in in_flight:
        work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    gb_per_s = num_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return SyncResult(state if is_src else received, version, num_bytes, seconds, gb_per_s)


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_header(version: int | None, layout: Layout, source_problem: str | None,
                     device: torch.device, group: dist.ProcessGroup | None) -> int:
    """All-reduce the version and the layout hash; a source whose state does not fit the layout
    sends hash 0, so every rank raises instead of the receivers hanging in a broadcast."""
    digest = 0 if source_problem else layout_hash(layout)
    header = torch.tensor([-1 if version is None else version, digest, -digest],
                          dtype=torch.int64, device=device)
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group)
    synced_version, max_digest, neg_min_digest = header.tolist()
    if source_problem:
        raise ValueError(f"sync_params: {source_problem}")
    if max_digest != digest or -neg_min_digest != digest:
        raise LayoutMismatchError(
            f"sync_params: ranks passed different layouts, or the source state does not fit "
            f"it (this rank's layout has {len(layout)} entries); see the source rank's error")
    return synced_version


def _check_source(state: dict[str, torch.Tensor] | None, version: int | None,
                  layout: Layout) -> str | None:
    if state is None or version is None or version < 0:
        return f"the source rank needs a state dict and a version >= 0, got version {version}"
    for name, shape, _ in layout:
        if name not in state:
            return f"the source state has no {name!r}"
        if tuple(state[name].shape) != shape:
            return (f"{name} has shape {tuple(state[name].shape)} in the source state, "
                    f"the layout says {shape}")
    return None


def _pack(bucket: Bucket, state: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's flat buffer on the source; a lone tensor already in place is sent as is."""
    tensors = [state[name] for name, _, _ in bucket.entries]
    if len(tensors) == 1:
        lone = tensors[0].detach().to(device=device, dtype=bucket.dtype)
        if lone.is_contiguous():
            return lone.view(-1)
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    with torch.no_grad():
        for (_, shape, offset), tensor in zip(bucket.entries, tensors, strict=True):
            flat[offset:offset + math.prod(shape)].view(shape).copy_(tensor)
    return flat


def _unpack(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: flat[offset:offset + math.prod(shape)].view(shape)
            for name, shape, offset in bucket.entries}
