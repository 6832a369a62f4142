"""`tiderl sim`: simulated cluster experiments driving the core policies (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.launch import SetOpt
from tiderl.cli.output import JsonFlag, Output, table
from tiderl.core.system import ALIASES, SYSTEM_CHOICES
from tiderl.profile import load_profile
from tiderl.sim.config import EXPERIMENTS, POLICIES

SWEEP_PROFILE = "sim/fig8-paper"


def sim(
    profile: str | None = typer.Argument(
        None, help="A profile (e.g. sim/cluster32 or a path); default: sim/EXPERIMENT."),
    experiment: str | None = typer.Option(
        None, "--experiment", "-e", help=f"One of {', '.join(EXPERIMENTS[1:])}, or 'all'."),
    policies: str | None = typer.Option(
        None, "--policies", help="Comma-separated systems to compare on the PROFILE, in place "
                                 "of its sim.experiment (not with --experiment): sync, async, "
                                 "stream, tiderl (verl, areal, streamrl mean the first three)."),
    overrides: list[str] | None = SetOpt,
    out: Path = typer.Option(Path("runs/sim"), "--out", help="Folder for PNG plots."),
    results: Path | None = typer.Option(
        None, "--results", help="Also write the headline numbers to this JSON file."),
    sweep: bool = typer.Option(
        False, "--sweep", help="Sweep environment latency (median x sigma), staleness and "
                               "verl's colocate switch around the profile (default "
                               f"{SWEEP_PROFILE}), 20-step runs of every system: a table, a "
                               "heat-map PNG in --out, the rows in --results."),
    json_mode: bool = JsonFlag,
) -> None:
    """Simulate a cluster run of each system (or a paper experiment) and compare goodput."""
    from tiderl.sim.runner import run_profile  # imported late: `tiderl --help` stays fast

    if sweep:
        _sweep(profile, experiment, overrides or [], out, results, Output(json_mode))
        return
    names = _experiments(experiment, profile)
    chosen = _policies(policies)
    if chosen is not None and experiment is not None:
        raise CLIError("tiderl sim: --policies compares systems on a PROFILE; an experiment "
                       "fixes its own, drop --experiment or --policies", EXIT_USAGE)
    output = Output(json_mode)
    headlines, payload = {}, []
    for name in names:
        resolved = load_profile(profile or f"sim/{name}", overrides or [])
        output.note(f"simulating {name or 'policy comparison'} ...")
        result = run_profile(resolved, name if experiment else None, chosen)
        plots = _plots(result, out)
        headlines[result.name] = {**result.headline, "paper": result.paper}
        payload.append({"experiment": result.name, "headline": result.headline,
                        "paper": result.paper, "rows": result.rows,
                        "plots": [str(p) for p in plots]})
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(headlines, indent=2) + "\n")
    output.result(payload if len(payload) > 1 else payload[0],
                  lambda console: _render(console, payload))


def _sweep(profile: str | None, experiment: str | None, overrides: list[str], out: Path,
           results: Path | None, output: Output) -> None:
    from tiderl.sim.report import write_sweep_heatmap
    from tiderl.sim.runner import run_profile_sweep

    if experiment is not None:
        raise CLIError("tiderl sim --sweep: takes a PROFILE, not --experiment", EXIT_USAGE)
    output.note("sweeping (a few minutes) ...")
    payload = run_profile_sweep(load_profile(profile or SWEEP_PROFILE, overrides))
    plot = write_sweep_heatmap(payload.pop("result"), out / "sim_sweep.png")
    payload["plots"] = [str(plot)]
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(payload, indent=2) + "\n")
    output.result(payload, lambda console: _render(console, [payload]))


def _experiments(experiment: str | None, profile: str | None) -> list[str]:
    if experiment is None:
        if profile is None:
            raise CLIError("tiderl sim: give a PROFILE or --experiment NAME", EXIT_USAGE)
        return [""]
    if experiment == "all":
        if profile is not None:
            raise CLIError("tiderl sim: --experiment all takes no PROFILE", EXIT_USAGE)
        return list(EXPERIMENTS[1:])
    if experiment not in EXPERIMENTS[1:]:
        raise CLIError(f"tiderl sim: unknown experiment {experiment!r} "
                       f"(known: {', '.join(EXPERIMENTS[1:])}, all)", EXIT_USAGE)
    return [experiment]


def _policies(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEM_CHOICES]
    if unknown or not names:
        aliases = ", ".join(f"{a} = {s}" for a, s in ALIASES.items())
        raise CLIError(f"tiderl sim --policies: unknown {', '.join(unknown) or 'empty list'} "
                       f"(known: {', '.join(POLICIES)}; {aliases})", EXIT_USAGE)
    return [ALIASES.get(n, n) for n in names]


def _plots(result, out: Path) -> list[Path]:
    from tiderl.sim.report import write_plots

    return write_plots(result, out)


def _render(console: Console, payload: list[dict]) -> None:
    for item in payload:
        rows = item["rows"]
        if rows:
            columns = list(rows[0])
            console.print(table(item["experiment"], columns, [[r.get(c) for c in columns]
                                                               for r in rows]))
        console.print(table(f"{item['experiment']}: simulated vs paper", ("figure", "value"),
                            _headline_rows(item["headline"], item["paper"])))
        for path in item["plots"]:
            console.print(f"plot: {path}", markup=False)


def _headline_rows(headline: dict, paper: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for key, value in headline.items():
        if key == "paper":
            continue
        if isinstance(value, dict):
            rows += _headline_rows(value, {}, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    rows += [(f"paper: {k}", json.dumps(v)) for k, v in paper.items()]
    return rows
