"""The engine's decode projections: fused groups of linears, through oneDNN on the CPU.

A decode step multiplies a few dozen rows (one per sequence) by every weight matrix, so the
number of GEMM calls counts as much as their size. :class:`PackedLinears` keeps one copy of each
*group* of ``nn.Linear`` layers that read the same input, their weights stacked along the output
dimension: a layer's q, k and v projections become one GEMM, the MLP's gate and up projections
another (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``, made at load time).

On a CPU with oneDNN each stacked weight is kept in oneDNN's own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` once, then ``_linear_pointwise``, the pair
inductor's weight freezing uses), which runs 2-2.5x as fast as ``F.linear`` for these shapes,
decode rows and prefill chunks alike (docs/engine.md). Elsewhere (another device, or bf16 on a
CPU without AVX-512) it is ``F.linear`` on the stacked weight.

oneDNN caches the primitive it builds for a GEMM (0.3-0.6 MiB each, measured) by the input's
shape, in two caches of 1,024 entries each (ideep's per thread, oneDNN's per process), and an
engine step's row count is its token count, anything from 1 to ``max_num_batched_tokens``: a
rollout rank grew from 176 to 971 MiB in 6 minutes as steps of new sizes filled them
(bench/memory_soak.py), and a GEMM of a new size took ~1 ms more to build its primitive (the
tiny model's q/k/v at ~700 rows: 1.9 against 0.8 ms). So a GEMM runs on its rows padded to
:func:`gemm_rows` (multiples of 8 to 128, then 8 sizes a power of two): at most 48 sizes up to
2,048 rows, each built once, for at most 1/8 more rows.

The copies cost the weights' memory once more; the parameters stay as they are (weight sync and
the trainer read them). The copies follow the parameters: :meth:`refresh` checks every weight's
storage and version counter and rebuilds all copies when any was written in place
(``update_weights``) or replaced (``sleep`` / ``wake_up``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

ROW_GRANULE = 8  # GEMM row counts are multiples of it
SIZES_PER_OCTAVE = 8  # above 16 granules: row counts between one power of two and the next


def gemm_rows(rows: int) -> int:
    """The row count a oneDNN GEMM of ``rows`` rows runs at: the next multiple of 8 up to 128,
    then of 1/8 of the next power of two (144, 160, ... 256, 288, ...), so that oneDNN builds
    and caches one primitive per size, not per step size, for at most 1/8 more rows."""
    octave_end = 1 << (rows - 1).bit_length()  # rows lies in (octave_end / 2, octave_end]
    step = max(ROW_GRANULE, octave_end // 2 // SIZES_PER_OCTAVE)
    return -(-rows // step) * step


@functools.cache
def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs here for ``dtype``: its bf16 path needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT, which a CPU with AVX2 alone lacks; probed once."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


class PackedLinears:
    def __init__(self, groups: Sequence[Sequence[nn.Linear]]) -> None:
        """``groups``: linears that share an input; each group runs as one GEMM whose output is
        the group's outputs side by side, and is called by its first member."""
        self.groups = [tuple(group) for group in groups]
        self.modules = [m for group in self.groups for m in group]
        # The Parameter objects (sleep and wake_up swap their storage, not the objects): the
        # per-step check reads them without nn.Module attribute lookups.
        self._weights = [m.weight for m in self.modules]
        self.enabled = onednn_available(self._weights[0].device, self._weights[0].dtype)
        self.packed: dict[nn.Linear, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._stamp: tuple[tuple[int, int], ...] = ()

    def __call__(self, first: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """The outputs of the group led by ``first`` on ``x``, concatenated."""
        weight, bias = self.packed[first]
        if not self.enabled:
            return F.linear(x, weight, bias)
        rows, padded = len(x), gemm_rows(len(x))
        if padded > rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]

    def refresh(self) -> None:
        """Rebuild every copy if any weight changed since the last call (call once a step)."""
        stamp = tuple((w.data_ptr(), w._version) for w in self._weights)
        if stamp != self._stamp:
            first = self._weights[0]
            self.enabled = onednn_available(first.device, first.dtype)
            self.packed = {group[0]: self._pack(group) for group in self.groups}
            self._stamp = stamp

    def _pack(self, group: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = torch.cat([m.weight.detach() for m in group]) if len(group) > 1 else \
            group[0].weight.detach()
        bias = None
        if any(m.bias is not None for m in group):
            bias = torch.cat([m.bias.detach() if m.bias is not None else
                              m.weight.new_zeros(m.out_features) for m in group])
        if self.enabled:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return weight, bias

    def clear(self) -> None:
        """Drop the copies (the engine sleeps: its weights are freed)."""
        self.packed, self._stamp = {}, ()
