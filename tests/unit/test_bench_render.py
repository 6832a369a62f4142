"""`tiderl bench e2e`, `bench ctb` and `bench engine` render every ratio their benches write (e2e:
with or without CPU ceilings)."""

import json
from pathlib import Path

from rich.console import Console

from tiderl.cli.bench import _render_ctb, _render_e2e, _render_engine

RESULT = Path(__file__).parents[2] / "bench" / "results" / "e2e.json"


def _render(result: dict) -> str:
    console = Console(record=True, width=200)
    _render_e2e(console, result)
    return console.export_text()


def test_every_ratio_is_shown_with_its_target_or_a_dash():
    result = json.loads(RESULT.read_text())
    result.pop("cpu_bounds", None)
    text = _render(result)
    for name in result["ratios"]:
        assert name in text
    assert "tiderl_over_stream" in text and "CPU ceiling" in text


def test_a_cpu_ceiling_is_shown_beside_its_ratio():
    result = json.loads(RESULT.read_text())
    result["cpu_bounds"] = {"tiderl_over_sync_at_most": 1.234}
    line = next(row for row in _render(result).splitlines() if "tiderl_over_sync " in row)
    assert "1.234" in line


def _rendered(render, name: str) -> tuple[dict, str]:
    """The committed ``bench/results/NAME``, and its rendering at 120 columns."""
    result = json.loads((RESULT.parent / name).read_text())
    console = Console(record=True, width=120)
    render(console, result)
    return result, console.export_text()


def test_bench_ctb_shows_each_policy_and_each_ratio_beside_the_paper():
    result, text = _rendered(_render_ctb, "ctb.json")
    for name in result["policies"]:
        assert name in text
    line = next(row for row in text.splitlines() if "hit_rate_ratio " in row)
    assert str(result["ratios"]["hit_rate_ratio"]) in line and "1.58" in line


def test_bench_engine_shows_each_decode_ratio_and_the_batch_32_split():
    result, text = _rendered(_render_engine, "engine.json")
    for key in result["decode_tok_s"]:
        assert key in text
    for key, split in result["b32_fp32_split"].items():
        line = next(row for row in text.splitlines() if f"{key} " in row)
        engine = split["engine"]
        assert f"{engine['prefill_ms']} / {engine['decode_step_ms']}" in line
        assert str(split["speedup"]) in line
        plain = split["engine_torch_kernels"]
        assert line.rstrip(" │|").endswith(f"{plain['prefill_ms']} / {plain['decode_step_ms']}")
    for key, mixed in result["mixed_step"].items():
        if isinstance(mixed, dict):
            line = next(row for row in text.splitlines() if f"{key} " in row)
            assert f"{mixed['apart_ms']} " in line and f"{mixed['padded_ms']} " in line
