"""`tiderl bench e2e` renders every ratio its bench writes, with or without CPU ceilings."""

import json
from pathlib import Path

from rich.console import Console

from tiderl.cli.bench import _render_e2e

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
