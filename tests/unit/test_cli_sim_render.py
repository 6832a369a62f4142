"""`tiderl sim`'s tables on hand-built results: they fit 80 columns without cutting a number,
and each paper figure stands beside the simulated number it is the paper's for."""

from __future__ import annotations

import io

from rich.console import Console

from tiderl.cli.sim import _render
from tiderl.sim.experiments import PAPER
from tiderl.sim.runner import SWEEP_PAPER

RUN = {"goodput_tok_s": 71147.7, "wall_s": 1829.1, "trained_tokens": 1_301_364_121,
       "discarded_tokens": 48_705_710, "kv_hit_rate": 0.8512, "rwt_s": 49423.2, "twt_s": 4352.4}
FIG8_ROWS = [{"model": model, "run": run, **RUN} for model in ("7b", "14b")
             for run in ("sync", "async 0.125", "async 0.25", "async 0.5", "stream", "tiderl")]
FIG8_HEADLINE = {model: {"goodput_tok_s": {"sync": 35873.1, "async": 69812.3, "stream": 16451.9,
                                           "tiderl": 71147.7},
                         "async_best_ratio": 0.5, "tiderl_over_sync": 1.983,
                         "tiderl_over_async": 1.019, "tiderl_over_stream": 4.325}
                 for model in ("7b", "14b")}
SWEEP_ROWS = [{"env_step_median_s": m, "env_step_sigma": 0.6, "max_staleness": 1,
               "colocate_switch_s": 5.0, "sync_tok_s": 14812.6, "async_tok_s": 34012.9,
               "stream_tok_s": 16233.1, "tiderl_tok_s": 36123.4, "tiderl_over_sync": 2.439,
               "tiderl_over_async": 1.062, "tiderl_over_stream": 2.225, "async_over_sync": 2.296}
              for m in (0.2, 1.0, 3.0)]
SWEEP_HEADLINE = {"steps": 20, "centre": {"env_step_median_s": 1.0, "env_step_sigma": 0.6},
                  "tiderl_over_sync": {"centre": 2.439, "min": 2.1, "max": 2.6},
                  "tiderl_over_async": {"centre": 1.062, "min": 1.04, "max": 1.09}}


def rendered(payload: list[dict], width: int = 80) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, highlight=False, soft_wrap=True)
    _render(console, payload)
    lines = out.getvalue().splitlines()
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    assert "…" not in out.getvalue()  # nothing cut
    return lines


def line_of(lines: list[str], figure: str) -> list[str]:
    """The cells of the headline table's row for ``figure``."""
    row = next(line for line in lines if line.startswith(f"│ {figure} "))
    return [cell.strip() for cell in row.strip("│").split("│")]


def test_fig8_tables_fit_80_columns_one_per_model_with_the_paper_beside():
    lines = rendered([{"experiment": "fig8", "headline": FIG8_HEADLINE, "paper": PAPER["fig8"],
                       "rows": FIG8_ROWS, "plots": []}])
    assert "fig8 7b" in lines and "fig8 14b" in lines  # split by model, no model column
    assert sum("1.30G" in line and "48.71M" in line and "71148" in line for line in lines) == 12
    assert line_of(lines, "7b.tiderl_over_sync") == ["7b.tiderl_over_sync", "1.983", "5.6"]
    assert line_of(lines, "7b.tiderl_over_stream") == ["7b.tiderl_over_stream", "4.325", "7.0"]
    # the paper's StreamRL 14B run did not finish: no figure beside that one
    assert line_of(lines, "14b.tiderl_over_stream") == ["14b.tiderl_over_stream", "4.325", ""]
    assert line_of(lines, "14b.goodput_tok_s.sync") == ["14b.goodput_tok_s.sync", "35873", ""]
    notes = " ".join(" ".join(line.split()) for line in lines
                     if not line.startswith(("│", "┃", "┏", "┡", "└")))
    assert "paper, note: over VeRL (sync)" in notes and "did not finish" in notes


def test_a_wide_table_is_split_by_columns_and_each_part_names_its_rows():
    lines = rendered([{"experiment": "sweep", "headline": SWEEP_HEADLINE, "paper": SWEEP_PAPER,
                       "rows": SWEEP_ROWS, "plots": ["runs/sim/sim_sweep.png"]}])
    assert "sweep (continued)" in lines
    first, second = lines.index("sweep"), lines.index("sweep (continued)")
    for part in (lines[first:second], lines[second:]):  # each row's point in both parts
        assert sum(line.startswith(("│ 0.2 ", "│ 1.0 ", "│ 3.0 ")) for line in part) == 3
    text = "\n".join(lines)
    for value in ("14813", "34013", "16233", "36123", "2.439", "1.062", "2.225", "2.296"):
        assert text.count(value) >= 3, value
    # one paper figure for the ratio: beside the centre, not repeated at the min and max
    assert line_of(lines, "tiderl_over_sync.centre")[1:] == ["2.439", "5.6"]
    assert line_of(lines, "tiderl_over_sync.min")[1:] == ["2.1", ""]
    assert line_of(lines, "tiderl_over_async.centre")[1:] == ["1.062", "1.8"]
    # a paper figure with no simulated number has a row of its own
    assert line_of(lines, "tiderl_over_stream")[1:] == ["", "7.0"]
    assert "plot: runs/sim/sim_sweep.png" in lines


def test_a_wider_terminal_keeps_one_table():
    lines = rendered([{"experiment": "sweep", "headline": SWEEP_HEADLINE, "paper": SWEEP_PAPER,
                       "rows": SWEEP_ROWS, "plots": []}], width=160)
    assert "sweep" in lines and "sweep (continued)" not in lines
