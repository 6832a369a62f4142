"""`tiderl sim`: simulated cluster experiments driving the core policies (no GPU needed).

While it runs, one line per simulation on stderr: which, n of N, time since the command began.
Its tables fit the terminal (80 columns when not a terminal): short headers that wrap, token
counts in k/M/G, and a table split by columns (the row's name repeated) where it would not fit.
"""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.options import SetOpt
from tiderl.cli.output import JsonFlag, Output, table
from tiderl.core.quote import short
from tiderl.core.system import ALIASES, SYSTEM_CHOICES
from tiderl.sim.config import EXPERIMENTS, POLICIES
from tiderl.sim.progress import Progress, usable_cpus, workers

SWEEP_PROFILE = "sim/fig8-paper"
HEADERS = {"goodput_tok_s": "goodput tok/s", "gen_tok_s": "gen tok/s", "kv_hit_rate": "KV hit",
           "rwt_s": "RWT s", "twt_s": "TWT s", "recomputed_tokens": "recomputed tokens",
           "env_step_median_s": "env median s", "env_step_sigma": "env sigma",
           "max_staleness": "max stale", "colocate_switch_s": "switch s"}
KEY_COLUMNS = ("run", "step_mode", "env_step_median_s", "env_step_sigma", "max_staleness",
               "colocate_switch_s")  # what names a row: repeated in each part of a split table


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
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print each scenario's job and what each system runs on it "
                                 "(the effective configuration); simulate nothing."),
    jobs: int = typer.Option(
        0, "--jobs", min=0, max=1024,
        help="Simulations run at once, in worker processes (each is independent and seeded: the "
             "same results); 0: one per CPU this process may use."),
    json_mode: bool = JsonFlag,
) -> None:
    """Simulate a cluster run of each system (or a paper experiment) and compare goodput."""
    from tiderl.profile import load_profile  # imported late: `tiderl --help` stays fast
    from tiderl.profile.scenario import scenario_of
    from tiderl.sim.runner import run_scenario

    num_workers = jobs or usable_cpus()
    if sweep:
        with workers(num_workers):
            _sweep(profile, experiment, overrides or [], out, results, Output(json_mode))
        return
    names = _experiments(experiment, profile)
    chosen = _policies(policies)
    if chosen is not None and experiment is not None:
        raise CLIError("tiderl sim: --policies compares systems on a PROFILE; an experiment "
                       "fixes its own, drop --experiment or --policies", EXIT_USAGE)
    output = Output(json_mode)
    if dry_run:
        views = [_effective(load_profile(profile or f"sim/{name}", overrides or []), name, chosen)
                 for name in names]
        output.result(views if len(views) > 1 else views[0],
                      lambda console: _render_effective(console, views))
        return
    clock = _Progress(output)
    headlines, payload = {}, []
    for index, name in enumerate(names, start=1):
        resolved = load_profile(profile or f"sim/{name}", overrides or [])
        progress = clock.reporter(name or "policy comparison", index, len(names))
        with workers(num_workers):
            result = run_scenario(scenario_of(resolved), name if experiment else None, chosen,
                                  progress)
        plots = _plots(result, out)
        headlines[result.name] = {**result.headline, "paper": result.paper,
                                  **({"device_s": result.device_s} if result.device_s else {}),
                                  **({"window_s": result.window_s} if result.window_s else {})}
        payload.append({"experiment": result.name, "headline": result.headline,
                        "paper": result.paper, "rows": result.rows,
                        "device_s": result.device_s, "window_s": result.window_s,
                        "plots": [str(p) for p in plots]})
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(headlines, indent=2) + "\n")
    clock.done()
    output.result(payload if len(payload) > 1 else payload[0],
                  lambda console: _render(console, payload))


class _Progress:
    """One stderr line as each simulation starts: what, n of N, time since the command began."""

    def __init__(self, output: Output):
        self.output = output
        self.started = time.monotonic()

    def reporter(self, name: str, index: int, count: int) -> Progress:
        part = f"{name} ({index}/{count})" if count > 1 else name

        def report(label: str, number: int, total: int) -> None:
            self.output.note(f"simulating {part} [{number}/{total}] {label}, "
                             f"{self.elapsed()} elapsed")
        return report

    def done(self) -> None:
        self.output.note(f"simulated in {self.elapsed()}")

    def elapsed(self) -> str:
        seconds = int(time.monotonic() - self.started)
        return f"{seconds // 60}:{seconds % 60:02d}"


def _sweep(profile: str | None, experiment: str | None, overrides: list[str], out: Path,
           results: Path | None, output: Output) -> None:
    from tiderl.profile import load_profile
    from tiderl.profile.scenario import scenario_of
    from tiderl.sim.report import write_sweep_heatmap
    from tiderl.sim.runner import run_scenario_sweep

    if experiment is not None:
        raise CLIError("tiderl sim --sweep: takes a PROFILE, not --experiment", EXIT_USAGE)
    clock = _Progress(output)
    payload = run_scenario_sweep(scenario_of(load_profile(profile or SWEEP_PROFILE, overrides)),
                                 progress=clock.reporter("sweep", 1, 1))
    clock.done()
    plot = write_sweep_heatmap(payload.pop("result"), out / "sim_sweep.png")
    payload["plots"] = [str(plot)]
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(payload, indent=2) + "\n")
    output.result(payload, lambda console: _render(console, [payload]))


def _effective(profile, name: str, chosen: list[str] | None) -> dict[str, Any]:
    """A scenario's job and, for each system it compares (an experiment: the four), what the
    system runs on it."""
    from dataclasses import asdict

    from tiderl.core.system import SystemSpec
    from tiderl.profile.scenario import scenario_of
    from tiderl.sim.cluster import scenario_effective_view

    scenario = scenario_of(profile)
    systems = chosen or (list(POLICIES) if name else scenario.sim.policies)
    return {"experiment": name or "policy comparison", "job": asdict(scenario.job),
            "systems": {system: scenario_effective_view(SystemSpec.named(system), scenario)
                        for system in systems}}


def _render_effective(console: Console, views: list[dict[str, Any]]) -> None:
    from tiderl.cli.launch import render_effective

    for view in views:
        console.print(table(f"{view['experiment']}: job", ("key", "value"),
                            list(view["job"].items())))
        for effective in view["systems"].values():
            render_effective(console, effective)


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
        raise CLIError(f"tiderl sim: unknown experiment {short(experiment)} "
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
    from tiderl.sim.experiments import device_shares

    for item in payload:
        for title, columns, rows in _row_tables(item["experiment"], item["rows"], console.width):
            console.print(table(title, columns, rows))
        if item.get("device_s"):
            for title, columns, rows in _row_tables(
                    f"{item['experiment']}: GPU-seconds by what they did, % of gpus x wall",
                    device_shares(item["device_s"]), console.width):
                console.print(table(title, columns, rows))
        if item.get("window_s"):
            places = [{"run": run, **parts} for run, parts in item["window_s"].items()]
            for title, columns, rows in _row_tables(
                    f"{item['experiment']}: a trained task's place in the staleness window, s",
                    places, console.width):
                console.print(table(title, columns, rows))
        figures, notes = _headline_rows(item["headline"], item["paper"])
        console.print(table(f"{item['experiment']}: simulated vs paper",
                            ("figure", "simulated", "paper"), figures))
        for key, note in notes:  # wrapped at the console's width, not cut
            console.print(Text(f"paper, {key}: {note}"), soft_wrap=False)
        for path in item["plots"]:
            console.print(f"plot: {path}", markup=False)


def _row_tables(title: str, rows: list[dict], width: int
                ) -> Iterator[tuple[str, list[str], list[list[str]]]]:
    """The rows as tables of at most ``width`` columns: one per model where rows name one (fig8),
    each split by columns where it is wider, the row's name in every part."""
    if not rows:
        return
    models = list(dict.fromkeys(row["model"] for row in rows if "model" in row))
    groups = [(f"{title} {m}", [r for r in rows if r.get("model") == m]) for m in models]
    for name, group in groups or [(title, rows)]:
        columns = [c for c in group[0] if c != "model"]
        cells = {c: [_cell(c, row.get(c)) for row in group] for c in columns}
        widths = {c: max([len(v) for v in cells[c]] + [len(w) for w in _header(c).split()])
                  for c in columns}
        for part, chosen in enumerate(_fit(columns, widths, width)):
            headers = [textwrap.fill(_header(c), widths[c]) for c in chosen]
            yield (name if not part else f"{name} (continued)", headers,
                   [[cells[c][i] for c in chosen] for i in range(len(group))])


def _fit(columns: list[str], widths: dict[str, int], width: int) -> list[list[str]]:
    """Columns packed into tables no wider than ``width`` (rich's default box: a column takes
    its width, two of padding and one rule), each starting with the key columns."""
    keys = [c for c in columns if c in KEY_COLUMNS]
    parts: list[list[str]] = []
    for column in (c for c in columns if c not in KEY_COLUMNS):
        if parts and sum(widths[c] + 3 for c in parts[-1]) + widths[column] + 4 <= width:
            parts[-1].append(column)
        else:
            parts.append([*keys, column])
    return parts or [keys]


def _header(column: str) -> str:
    return HEADERS.get(column, column.replace("_tok_s", " tok/s").replace("_", " "))


def _cell(column: str, value: Any) -> str:
    """A table cell: token counts in k/M/G, large numbers without decimals."""
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool) and column.endswith("tokens"):
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
            if abs(value) >= scale:
                return f"{value / scale:.{1 if suffix == 'k' else 2}f}{suffix}"
    if isinstance(value, float) and abs(value) >= 1000:
        return f"{value:.0f}"
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


def _headline_rows(headline: dict, paper: dict) -> tuple[list[tuple[str, str, str]],
                                                         list[tuple[str, str]]]:
    """(figure, simulated, paper) rows and the paper's notes. A paper figure stands beside the
    headline number at the same path, or beside the first one under it (the sweep's centre);
    a paper figure with no simulated number gets a row of its own."""
    rows, used = [], set()
    for path, value in _leaves(headline):
        figure, at = _paper_at(paper, path)
        if at is not None and at in used:
            figure = None  # shown beside an earlier number of its group
        used.add(at)
        rows.append((".".join(path), _cell("", value), _cell("", figure)))
    notes = []
    for path, value in _leaves(paper):
        if isinstance(value, str):
            notes.append((".".join(path), value))
        elif path not in used:
            rows.append((".".join(path), "", _cell("", value)))
    return rows, notes


def _leaves(tree: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _paper_at(paper: dict, path: tuple[str, ...]) -> tuple[Any, tuple[str, ...] | None]:
    """The paper's figure at ``path`` or at a prefix of it, and where; (None, None): none."""
    node: Any = paper
    for depth, key in enumerate(path, start=1):
        if not isinstance(node, dict) or key not in node:
            return None, None
        node = node[key]
        if not isinstance(node, dict):
            return (None, None) if isinstance(node, str) else (node, path[:depth])
    return None, None
