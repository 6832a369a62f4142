"""The non-GEMM parts of an engine step, two ways: C++ kernels on the CPU, plain torch elsewhere.

Measured on the 2-core machine (batch 32 decoding, docs/engine.md): outside its GEMMs a decode
step of the small model spent 2.1 ms a step gathering each sequence's KV blocks into contiguous
copies for the attention matmuls, 0.9 ms in the masked matmuls and softmax, and most of the rest
in about 25 small ATen calls per layer (norms, rotary, cache writes, residual adds), each a few
microseconds of dispatch for a few microseconds of work. ``csrc/kernels.cpp`` does these parts in
four in-place calls per layer, the four vLLM's CPU backend has (``fused_add_rms_norm``,
``silu_and_mul``, ``rotary_embedding`` with ``reshape_and_cache``, ``paged_attention``); the
attention reads each key and value where it lies in the paged cache. A fifth C++ call,
``decode_layers``, runs a decode step's whole layer loop (projections and the four kernels) with
no Python between them; it has no torch twin (the runner's Python loop is that).

:class:`TorchKernels` computes the same four in plain torch: the reference the tests hold the C++
ones to (tests/unit/test_kernels.py), and the path on other devices or where no compiler is.

Build: on first use, or ``python -m tiderl.engine.kernels`` (which ``make`` runs after
installing), the system's C++ compiler (``$CXX``, else ``g++``) builds the source against the
installed torch into ``$TIDERL_CACHE_DIR`` (default ``~/.cache/tiderl``), one library per
source, torch version, compiler and CPU (``-march=native``), under a file lock; later processes
only load it (milliseconds). ``engine.kernels``: ``auto`` (native on the CPU when it builds, else
torch, with one warning), ``native`` (an error when it does not build), ``torch``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tiderl.models.attention import gather_heads, write_kv

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-fPIC",
         "-shared", "-std=c++20")


class KernelsUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded (the message says why, in one line)."""


class Kernels(Protocol):
    """The four in-place operations of a step (``csrc/kernels.cpp`` documents each)."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> None: ...

    def silu_and_mul(self, out: torch.Tensor, x: torch.Tensor) -> None: ...

    def rotary_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        heads: int, kv_heads: int) -> None: ...

    def paged_decode_attention(self, out: torch.Tensor, q: torch.Tensor,
                               layer_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float) -> None: ...


class TorchKernels:
    """The four operations in plain torch, on any device."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> None:
        """``residual += x`` when given; then ``x = rms_norm(residual or x) * weight``. In float32
        one fused ``F.rms_norm``; in other dtypes as :class:`~tiderl.models.qwen2.RMSNorm`
        (normalised in float32, rounded, then multiplied by the weight)."""
        source = x if residual is None else residual.add_(x)
        if x.dtype == torch.float32:
            x.copy_(F.rms_norm(source, weight.shape, weight, eps))
            return
        y = source.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        torch.mul(weight, y.to(x.dtype), out=x)

    @staticmethod
    def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
        gate, up = x.chunk(2, dim=-1)
        torch.mul(F.silu(gate), up, out=out)

    @staticmethod
    def rotary_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        heads: int, kv_heads: int) -> None:
        """Rotate q and k of ``qkv`` [T, (H + 2 Hkv) D] in place, ``x cos + rotate_half(x) sin``
        written as ``x cos + swap_halves(x) sin_folded`` (``sin`` has its first half negated),
        with each position's row of the tables; then store k and v at their slots."""
        num_tokens, dim = len(qkv), layer_cache.shape[-1]
        width = (heads + kv_heads) * dim
        qk = qkv[:, :width].view(num_tokens, heads + kv_heads, dim)
        swapped = torch.cat((qk[..., dim // 2:], qk[..., :dim // 2]), dim=-1)
        rows = (num_tokens, 1, dim)
        qk.copy_(torch.addcmul(qk * cos.index_select(0, positions).view(rows), swapped,
                               sin.index_select(0, positions).view(rows)))
        write_kv(layer_cache, qk[:, heads:], qkv[:, width:].view(num_tokens, kv_heads, dim),
                 slot_mapping)

    @staticmethod
    def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, layer_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> None:
        """One query token per sequence, q [B, H, D] -> ``out`` [B, H, D]: each sequence's blocks
        gathered for every KV head by one ``index_select`` into [Hkv * B, L, D] (float32; the
        cache is head-major, so no second copy), then two batched matmuls with the query heads of
        a KV head as the rows of one problem (grouped-query attention without repeating keys),
        keys past each context masked, scores and softmax in float32."""
        num_seqs, heads, dim = q.shape
        keys, values = gather_heads(layer_cache, block_tables)
        kv_heads = len(keys) // num_seqs
        groups = heads // kv_heads
        key_pos = torch.arange(keys.shape[1], device=q.device)
        bias = torch.zeros((1, num_seqs, 1, len(key_pos)), device=q.device)
        bias.masked_fill_(key_pos >= context_lens.view(1, -1, 1, 1), float("-inf"))
        bias = bias.expand(kv_heads, -1, groups, -1).reshape(len(keys), groups, -1)
        rows = q.reshape(num_seqs, kv_heads, groups, dim).transpose(0, 1).float()
        scores = torch.baddbmm(bias, rows.reshape(len(keys), groups, dim), keys.transpose(1, 2),
                               alpha=scale)
        attended = torch.bmm(scores.softmax(dim=-1), values)  # [Hkv * B, G, D]
        out.copy_(attended.view(kv_heads, num_seqs, groups, dim).transpose(0, 1).reshape(
            num_seqs, heads, dim))


_lock = threading.Lock()
_native: Any = None  # torch.ops.tiderl once loaded
_failure: str | None = None  # why it could not be, once tried


def kernels_for(device: torch.device, choice: str = "auto") -> Kernels:
    """The kernels an engine on ``device`` uses under ``engine.kernels`` = ``choice``."""
    if choice == "torch" or device.type != "cpu":
        if choice == "native" and device.type != "cpu":
            raise KernelsUnavailable(f"engine.kernels=native runs on the CPU, not {device.type}")
        return TorchKernels()
    try:
        return native_kernels()
    except KernelsUnavailable as exc:
        if choice == "native":
            raise
        log.warning("engine: plain torch kernels (%s)", exc)
        return TorchKernels()


def native_kernels() -> Any:
    """``torch.ops.tiderl``, built if needed; :class:`KernelsUnavailable` if it cannot be."""
    global _native, _failure
    with _lock:
        if _native is None and _failure is None:
            try:
                torch.ops.load_library(str(build()))
                _native = torch.ops.tiderl
            except KernelsUnavailable as exc:
                _failure = str(exc)
            except OSError as exc:
                _failure = f"the built library did not load: {exc}"
        if _native is None:
            raise KernelsUnavailable(_failure)
        return _native


def library_path() -> Path:
    """Where the library for this source, torch, compiler and CPU is (or will be) cached."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), compiler().encode(),
                 " ".join(FLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    root = Path(os.environ.get("TIDERL_CACHE_DIR") or Path.home() / ".cache" / "tiderl")
    return root / f"kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The library, compiled first when it is not cached (tens of seconds, once)."""
    target = library_path()
    if target.exists():
        return target
    if shutil.which(compiler()) is None:
        raise KernelsUnavailable(f"no C++ compiler {compiler()!r} (set CXX or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "kernels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others then find it
        if target.exists():
            return target
        from torch.utils.cpp_extension import include_paths, library_paths

        partial = target.with_suffix(f".{os.getpid()}.tmp")
        command = [compiler(), *FLAGS,
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *(f"-I{p}" for p in include_paths()), str(SOURCE),
                   *(f"-L{p}" for p in library_paths()), "-ltorch_cpu", "-lc10",
                   "-o", str(partial)]
        log.info("engine: building the C++ kernels into %s (once)", target)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise KernelsUnavailable(f"{compiler()} failed: "
                                     f"{(errors or done.stderr.splitlines() or ['?'])[0]}")
        os.replace(partial, target)
    return target


def compiler() -> str:
    return os.environ.get("CXX") or "g++"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), platform.machine())
    except OSError:
        return platform.machine()


if __name__ == "__main__":  # make: build once after installing (a failure is only reported)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"engine kernels: {build()}")
    except KernelsUnavailable as exc:
        print(f"engine kernels: not built, the engine uses plain torch ({exc})", file=sys.stderr)
