"""The engine's oneDNN GEMMs run on padded row counts: oneDNN builds and caches one primitive
per input shape, so a rank that ran every step size it met grew by hundreds of MiB."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.native import native_or_skip
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.packed_linear import PackedLinears, gemm_rows
from tiderl.engine.request import SamplingParams
from tiderl.models.random_init import init_model


def test_gemm_rows_are_few_sizes_each_at_most_an_eighth_above_the_rows():
    sizes = [gemm_rows(rows) for rows in range(1, 2049)]
    assert sorted(set(sizes)) == [*range(8, 129, 8), *range(144, 257, 16), *range(288, 513, 32),
                                  *range(576, 1025, 64), *range(1152, 2049, 128)]
    assert all(size >= rows for rows, size in enumerate(sizes, start=1))
    assert all(gemm_rows(size) == size for size in sizes)
    assert max((size - rows) / rows for rows, size in enumerate(sizes, start=1) if rows > 128) \
        <= 1 / 8
    assert gemm_rows(2049) == 2304  # on past the chunked-prefill budget, 8 sizes an octave


def test_padded_rows_give_the_unpadded_result():
    layers = [torch.nn.Linear(24, 40), torch.nn.Linear(24, 8, bias=False)]
    packed = PackedLinears([layers])
    packed.refresh()
    with torch.inference_mode():
        for rows in (1, 7, 8, 9, 130):
            x = torch.randn(rows, 24)
            expected = torch.cat([F.linear(x, m.weight, m.bias) for m in layers], dim=1)
            torch.testing.assert_close(packed(layers[0], x), expected, atol=1e-5, rtol=1e-5)


class GemmShapes(TorchDispatchMode):
    """Records the row count of every oneDNN GEMM called from Python and the row counts the
    C++ ``decode_layers`` is given: (its sequences, the rows its GEMMs run at)."""

    def __init__(self) -> None:
        super().__init__()
        self.gemm_rows: list[int] = []
        self.decode_rows: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.mkldnn._linear_pointwise.default:
            self.gemm_rows.append(args[0].shape[0])
        elif func.name() == "tiderl::decode_layers":
            self.decode_rows.append((args[0].shape[0], args[-1]))
        return func(*args, **(kwargs or {}))


def test_the_engine_runs_its_gemms_on_padded_row_counts_whatever_its_step_sizes():
    """Steps of many token counts (prefill chunks of prompts of 3..25 tokens, decode batches of
    1..23 sequences) reach oneDNN as a handful of row counts, each a gemm_rows size."""
    with native_or_skip():
        engine = LLMEngine(init_model("tiny", seed=0),
                           EngineConfig(kv_cache_tokens=2048, block_size=4,
                                        max_num_batched_tokens=96, kernels="native"), None)
    if not engine.runner.linears.enabled:
        pytest.skip("oneDNN's packed linear does not run here")
    requests = [engine.add_request(f"t{i}", list(range(10, 13 + i)),
                                   SamplingParams(max_tokens=1 + i % 6, temperature=0.0))
                for i in range(23)]
    with GemmShapes() as shapes:
        while not all(request.is_finished for request in requests):
            engine.step()
    assert shapes.gemm_rows and shapes.decode_rows
    assert all(gemm_rows(rows) == rows for rows in shapes.gemm_rows)
    assert all(padded == gemm_rows(seqs) for seqs, padded in shapes.decode_rows)
    assert len({seqs for seqs, _ in shapes.decode_rows}) > len({p for _, p in shapes.decode_rows})
