"""The engine's C++ kernels against their plain-torch twins (tiderl/engine/kernels.py), and the
build's failures: each kernel on the shapes a step gives it (strided q and qkv rows, grouped
heads, contexts ending inside a block, padded block tables), float32 and bfloat16."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.native import native_or_skip
from tiderl.engine.kernels import KernelsUnavailable, TorchKernels, build, kernels_for


@pytest.fixture(scope="module")
def native():
    with native_or_skip():
        return kernels_for(torch.device("cpu"), "native")


TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}  # bf16: one rounding step of the output
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_equals_the_torch_twin(native, dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(7, 96, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(96, generator=gen).to(dtype) + 0.5
    out = {}
    for name, kernels in (("torch", TorchKernels()), ("native", native)):
        xs, rs = x.clone(), residual.clone()
        kernels.add_rms_norm(xs, rs if with_residual else None, weight, 1e-6)
        out[name] = xs, rs
    torch.testing.assert_close(out["native"][0], out["torch"][0], atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out["native"][1], out["torch"][1])  # one rounded add: bit-equal
    assert with_residual != torch.equal(out["native"][1], residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_the_torch_twin(native, dtype):
    gate_up = (torch.randn(9, 2 * 160, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -88.5])  # beyond the exp clamp
    ours, theirs = (torch.full((9, 160), float("nan"), dtype=dtype) for _ in range(2))
    native.silu_and_mul(ours, gate_up)
    TorchKernels.silu_and_mul(theirs, gate_up)
    torch.testing.assert_close(ours, theirs, atol=TOL[dtype], rtol=TOL[dtype])


def rotary_tables(positions: int, dim: int, dtype: torch.dtype):
    angles = torch.arange(positions).float().unsqueeze(-1) / 10000 ** (
        torch.arange(0, dim, 2).float() / dim)
    angles = torch.cat((angles, angles), dim=-1)
    folded = angles.sin()
    folded[:, :dim // 2].neg_()
    return angles.cos().to(dtype), folded.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_write_kv_equals_the_torch_twin(native, dtype):
    heads, kv_heads, dim, blocks, block_size = 4, 2, 32, 6, 4
    gen = torch.Generator().manual_seed(2)
    # Rows strided as a view of a wider buffer, as a GEMM output slice may be.
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim + 8, generator=gen).to(dtype)[:, 8:]
    positions = torch.tensor([0, 3, 17, 4, 29])
    slots = torch.tensor([1, 22, 7, 12, 16])
    cos, sin = rotary_tables(40, dim, dtype)
    results = []
    for kernels in (TorchKernels(), native):
        rows, cache = qkv.clone(), torch.zeros(2, kv_heads, blocks, block_size, dim, dtype=dtype)
        kernels.rotary_write_kv(rows, positions, cos, sin, cache, slots, heads, kv_heads)
        results.append((rows, cache))
    (theirs, their_cache), (ours, our_cache) = results
    torch.testing.assert_close(ours, theirs, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(our_cache, their_cache, atol=TOL[dtype], rtol=TOL[dtype])
    written = our_cache.view(2, kv_heads, -1, dim).abs().sum(dim=(0, 1, 3)) > 0
    assert written.nonzero().flatten().tolist() == sorted(slots.tolist())
    assert not torch.equal(ours, qkv)  # rotated in place (position 0 alone is unchanged)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 4, 32), (4, 1, 64), (6, 6, 48),
                                                        (4, 2, 128)])
def test_paged_decode_attention_equals_the_torch_twin(native, dtype, heads, kv_heads, dim):
    """Head dimensions with their own compiled loops (32, 64, 128) and the generic one (48);
    GQA group sizes 1, 2 and 4; contexts ending inside a block, one of a single token; block
    tables padded with their first block; q a strided view of the qkv rows."""
    blocks, block_size = 24, 16
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, kv_heads, blocks, block_size, dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 16, 37, 80, 5])
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:6] for _ in lens])
    for row, n in enumerate(lens.tolist()):
        tables[row, -(-n // block_size):] = tables[row, 0]
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q = qkv[:, :heads]
    ours, theirs = (torch.empty(len(lens), heads, dim, dtype=dtype) for _ in range(2))
    native.paged_decode_attention(ours, q, cache, tables, lens, dim ** -0.5)
    TorchKernels.paged_decode_attention(theirs, q, cache, tables, lens, dim ** -0.5)
    torch.testing.assert_close(ours, theirs, atol=TOL[dtype], rtol=TOL[dtype])
    # The single-token context attends to that token alone: its value, exactly (up to rounding).
    first = cache[1, :, tables[0, 0], 0].repeat_interleave(heads // kv_heads, dim=0)
    torch.testing.assert_close(ours[0], first, atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_shapes_and_dtypes_are_one_line_errors(native):
    cache = torch.zeros(2, 2, 4, 4, 32)
    q, out = torch.zeros(3, 4, 32), torch.zeros(3, 4, 32)
    tables, lens = torch.zeros(3, 2, dtype=torch.long), torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError, match="one dtype for q, out and cache"):
        native.paged_decode_attention(out, q.double(), cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="context length outside its block table"):
        native.paged_decode_attention(out, q, cache, tables, torch.tensor([1, 2, 9]), 1.0)
    with pytest.raises(RuntimeError, match=r"out \[..., I\] and x \[..., 2I\]"):
        native.silu_and_mul(torch.zeros(2, 5), torch.zeros(2, 9))


def test_a_missing_compiler_is_one_line_and_auto_falls_back_to_torch(tmp_path, monkeypatch):
    env = {"CXX": "no-such-c++", "TIDERL_CACHE_DIR": str(tmp_path)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(KernelsUnavailable, match="no C\\+\\+ compiler 'no-such-c\\+\\+'"):
        build()
    # A fresh process (the loaded library is per process): auto falls back, native refuses.
    code = ("import logging, torch\nlogging.basicConfig()\n"
            "from tiderl.engine.kernels import kernels_for, TorchKernels, KernelsUnavailable\n"
            "assert isinstance(kernels_for(torch.device('cpu'), 'auto'), TorchKernels)\n"
            "try:\n    kernels_for(torch.device('cpu'), 'native')\n"
            "except KernelsUnavailable as exc:\n    print('native:', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "engine: plain torch kernels (no C++ compiler 'no-such-c++'" in done.stderr
    assert done.stdout.strip() == ("native: no C++ compiler 'no-such-c++' "
                                   "(set CXX or install g++)")
    assert list(tmp_path.iterdir()) == []


def test_a_failing_compiler_leaves_nothing_behind(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "cxx-that-fails"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'fatal error: no space left on device' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("TIDERL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(KernelsUnavailable, match="failed: fatal error: no space left on device"):
        build()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["kernels.lock"]
