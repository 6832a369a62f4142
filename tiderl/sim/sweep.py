"""A sweep of the calibration values the paper does not publish, around a scenario.

    grid: env median x env sigma (the heat map, at the central staleness and switch cost)
        + staleness bound eta, one value at a time at the central environment point
        + sync's colocate switch, one value at a time at the central environment point
    each point: sync, async (the scenario's split), stream, tiderl on the same task stream
    out: one row per point (goodput per system, tiderl over each, async over sync, the point's
         goodput bound and each system's fraction of it: tiderl.sim.bound)

The environment's step latency is the one constant no source publishes for the text workloads
(calibration §7); the staleness bound and the framework switch costs differ between the paper's
frameworks. A point is a short run (``SweepGrid.steps``, 20 by default against the paper's 100):
the ratios, not the absolute goodput, are what the sweep bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from tiderl.sim.bound import scenario_bound
from tiderl.sim.cluster import SimResult, simulate
from tiderl.sim.progress import Progress, run_all
from tiderl.sim.scenario import SYSTEMS, SimScenario

SYSTEM_ORDER = ("sync", "async", "stream", "tiderl")


@dataclass(frozen=True)
class SweepGrid:
    """The values swept; the central point is the scenario's own (its env latency, eta, switch)."""

    steps: int = 20
    env_median_s: tuple[float, ...] = (0.2, 1.0, 3.0)
    env_sigma: tuple[float, ...] = (0.6, 1.0)
    max_staleness: tuple[int, ...] = (2,)
    colocate_switch_s: tuple[float, ...] = (0.0,)

    def points(self, base: SimScenario) -> list[dict[str, float]]:
        """The heat map's cells, then each other value of eta and the switch at the centre."""
        centre = _centre(base)
        cells = [{**centre, "env_step_median_s": m, "env_step_sigma": s}
                 for m in self.env_median_s for s in self.env_sigma]
        cells += [{**centre, "max_staleness": eta} for eta in self.max_staleness
                  if eta != base.job.max_staleness]
        cells += [{**centre, "colocate_switch_s": c} for c in self.colocate_switch_s
                  if c != base.sim.colocate_switch_s]
        return cells


@dataclass
class SweepResult:
    grid: SweepGrid
    centre: dict[str, float]
    rows: list[dict[str, Any]]


def run_sweep(base: SimScenario, grid: SweepGrid,
              progress: Progress | None = None) -> SweepResult:
    """Every point of ``grid`` around ``base`` (``base.job.steps`` is replaced by ``grid.steps``);
    ``progress`` hears of each system's run at each point as it starts."""
    points = grid.points(base)
    runs = {f"{_label(point)}: {name}": partial(simulate, SYSTEMS[name], _at(base, grid, point))
            for point in points for name in SYSTEM_ORDER}
    done = run_all(runs, progress)
    rows = [_point({name: done[f"{_label(point)}: {name}"] for name in SYSTEM_ORDER}, point,
                   scenario_bound(_at(base, grid, point)).tok_s)
            for point in points]
    return SweepResult(grid, _centre(base), rows)


def _centre(base: SimScenario) -> dict[str, float]:
    return {"env_step_median_s": base.sim.env_step_median_s,
            "env_step_sigma": base.sim.env_step_sigma, "max_staleness": base.job.max_staleness,
            "colocate_switch_s": base.sim.colocate_switch_s}


def _at(base: SimScenario, grid: SweepGrid, point: dict[str, float]) -> SimScenario:
    """``base`` at one point of the grid, for ``grid.steps`` steps."""
    sim = {k: v for k, v in point.items() if k != "max_staleness"}
    return base.with_sim(**sim).with_job(steps=grid.steps,
                                         max_staleness=int(point["max_staleness"]))


def _label(point: dict[str, float]) -> str:
    return (f"env {point['env_step_median_s']:g} s sigma {point['env_step_sigma']:g}, "
            f"eta {point['max_staleness']}, switch {point['colocate_switch_s']:g} s")


def _point(results: dict[str, SimResult], point: dict[str, float],
           bound_tok_s: float) -> dict[str, Any]:
    goodput = {name: result.goodput_tok_s for name, result in results.items()}
    row: dict[str, Any] = dict(point)
    row.update({f"{name}_tok_s": round(value, 1) for name, value in goodput.items()})
    for name in ("sync", "async", "stream"):
        row[f"tiderl_over_{name}"] = _ratio(goodput["tiderl"], goodput[name])
    row["async_over_sync"] = _ratio(goodput["async"], goodput["sync"])
    row["bound_tok_s"] = round(bound_tok_s, 1)
    row.update({f"{name}_of_bound": _ratio(value, bound_tok_s) for name, value in goodput.items()})
    return row


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def heatmap_cells(result: SweepResult, key: str) -> tuple[list[float], list[float],
                                                          list[list[float | None]]]:
    """(env medians, env sigmas, values[sigma][median]) of ``key`` over the heat map's cells
    (the rows at the central staleness and switch cost)."""
    centre = result.centre
    cells = [r for r in result.rows if r["max_staleness"] == centre["max_staleness"]
             and r["colocate_switch_s"] == centre["colocate_switch_s"]]
    medians, sigmas = list(result.grid.env_median_s), list(result.grid.env_sigma)
    values = [[next((r[key] for r in cells if r["env_step_median_s"] == m
                     and r["env_step_sigma"] == s), None) for m in medians] for s in sigmas]
    return medians, sigmas, values
