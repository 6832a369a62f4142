"""The engine's decode projections through oneDNN with weights reordered once (CPU).

A decode step multiplies a few dozen rows (one per sequence) by every weight matrix. For those
shapes oneDNN with its weights kept in its own blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` once, then ``_linear_pointwise``, the pair
inductor's weight freezing uses) runs about twice as fast as ``F.linear`` on the CPU
(bench/engine.py, docs/engine.md), and fuses the SwiGLU gate's SiLU ("swish") into its GEMM.

:class:`PackedLinears` keeps one reordered copy of each ``nn.Linear`` weight of a model (the
weights' memory twice; the parameters stay as they are: prefill, weight sync and the trainer
read them). The copies follow the parameters: each call checks every weight's storage and
version counter, and reorders them all again when any was written in place
(``update_weights``) or replaced (``sleep`` / ``wake_up``). Elsewhere than on a CPU with
oneDNN it is plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {"none": "none", "silu": "swish"}  # ours -> oneDNN's post-op name


def onednn_available(device: torch.device) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinears:
    def __init__(self, model: nn.Module) -> None:
        self.modules = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self.enabled = onednn_available(next(model.parameters()).device)
        self.packed: dict[nn.Linear, torch.Tensor] = {}
        self._stamp: tuple[tuple[int, int], ...] = ()

    def __call__(self, module: nn.Linear, x: torch.Tensor, activation: str = "none"
                 ) -> torch.Tensor:
        """``module(x)``, then the activation (``none`` or ``silu``)."""
        if not self.enabled:
            out = F.linear(x, module.weight, module.bias)
            return F.silu(out) if activation == "silu" else out
        return torch.ops.mkldnn._linear_pointwise(x, self.packed[module], module.bias,
                                                  _ACTIVATIONS[activation], [], "")

    def refresh(self) -> None:
        """Reorder every weight again if any changed since the last call (call once a step)."""
        if not self.enabled:
            return
        stamp = tuple((m.weight.data_ptr(), m.weight._version) for m in self.modules)
        if stamp != self._stamp:
            self.packed = {m: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
                            for m in self.modules}
            self._stamp = stamp

    def clear(self) -> None:
        """Drop the copies (the engine sleeps: its weights are freed)."""
        self.packed, self._stamp = {}, ()
