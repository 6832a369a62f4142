"""The run report's figures read back from their artists (real matplotlib, Agg): the goodput axis
starts at 0, the solved fraction is plotted, and no step is missing from the readiness plane."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tests.unit.test_runtime_report import _metrics
from tiderl.core.records import StepRecord
from tiderl.core.system import StepMode
from tiderl.runtime.report import goodput_reward_figure, pyplot, readiness_figure

SOLVED = [None, 0.25, 0.5, 0.5, 0.75, 1.0]


def records() -> list[StepRecord]:
    """Six steps at 10-15 tok/s; steps 0 and 1 colocated without a TPRM, step 2 colocated at
    the very point (RAS 2, TPRM 0.8) of decoupled step 5."""
    rows = [dataclasses.replace(m, solved_frac=s) for m, s in zip(_metrics(), SOLVED, strict=True)]
    rows[2] = dataclasses.replace(rows[2], step_mode=StepMode.COLOCATED, ras=2, tprm_s=0.8)
    return rows


def axis(fig, ylabel: str):
    return next(ax for ax in fig.axes if ax.get_ylabel() == ylabel)


def test_goodput_axis_starts_at_zero_and_the_solved_fraction_is_plotted():
    metrics = records()
    fig = goodput_reward_figure(metrics)
    try:
        goodput = axis(fig, "goodput (tok/s)")
        assert min(goodput.lines[0].get_ydata()) >= 10  # far from 0, yet the axis starts there
        assert goodput.get_ylim()[0] == 0
        solved = axis(fig, "solved fraction")
        (line,) = solved.lines
        assert list(line.get_xdata()) == [m.time_s for m in metrics]
        ys = list(line.get_ydata())
        assert math.isnan(ys[0]) and ys[1:] == SOLVED[1:]  # a step with nothing solved-or-not
        assert solved.get_ylim()[0] == 0 and solved.get_ylim()[1] >= 1
    finally:
        pyplot().close(fig)


def test_every_step_is_on_the_readiness_plane_and_colocated_is_drawn_on_top():
    metrics = records()
    fig = readiness_figure(metrics)
    try:
        (ax,) = fig.axes
        by_label = {c.get_label(): c for c in ax.collections}
        assert sum(len(c.get_offsets()) for c in ax.collections) == len(metrics)
        null = by_label["colocated, TPRM null (on the RAS axis)"]
        assert [x for x, _ in null.get_offsets()] == [m.ras for m in metrics if m.tprm_s is None]
        assert null.get_offset_transform() == ax.get_xaxis_transform()  # y on the axis line
        low, high = ax.get_xlim()
        assert all(low < m.ras < high for m in metrics)
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "colocated, TPRM null (on the RAS axis)" in legend
        assert "2 with TPRM null" in ax.get_title()

        colocated, decoupled = by_label["colocated"], by_label["decoupled"]
        assert [list(p) for p in colocated.get_offsets()] == [[2, 0.8]]
        assert [2, 0.8] in [list(p) for p in decoupled.get_offsets()]  # the same point
        assert colocated.get_zorder() > decoupled.get_zorder()
        assert not np.array_equal(colocated.get_paths()[0].vertices,
                                  decoupled.get_paths()[0].vertices)  # and another marker
    finally:
        pyplot().close(fig)


def test_a_run_without_any_tprm_still_shows_its_steps():
    metrics = [dataclasses.replace(m, tprm_s=None) for m in records()]
    fig = readiness_figure(metrics)
    try:
        (ax,) = fig.axes
        assert sum(len(c.get_offsets()) for c in ax.collections) == len(metrics)
        assert {c.get_label() for c in ax.collections} == {
            "colocated, TPRM null (on the RAS axis)", "decoupled, TPRM null (on the RAS axis)"}
        assert ax.get_ylim() == (0, 1)
    finally:
        pyplot().close(fig)
