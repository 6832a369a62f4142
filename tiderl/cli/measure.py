"""`tiderl measure kv|readiness`: KV-cache hit rate and RAS/TPRM of a job or an engine."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.options import seconds_option
from tiderl.cli.output import JsonFlag, Output, table

app = typer.Typer(help="Measure a running job or engine: KV cache and readiness.",
                  no_args_is_help=True)

RunRootOpt = typer.Option(None, "--run-root",
                          help="Folder of run folders (default: runtime.run_dir).")


@app.command("kv")
def kv(
    job: str | None = typer.Option(None, "--job", help="Job id in runs/ (its coordinator)."),
    engine: str | None = typer.Option(None, "--engine",
                                      help="Engine base URL (TideRL, vLLM or SGLang)."),
    run_root: Path | None = RunRootOpt,
    duration: float = seconds_option(10.0, "--duration", help="Seconds to sample for."),
    interval: float = seconds_option(1.0, "--interval", help="Seconds between samples."),
    out: Path | None = typer.Option(None, "--out", help="Also plot both series to this PNG."),
    json_mode: bool = JsonFlag,
) -> None:
    """KV-cache hit rate and usage over time, from the engine's Prometheus metrics."""
    from tiderl.launch import measure

    if (job is None) == (engine is None):
        raise CLIError("tiderl measure kv: give exactly one of --job JOB or --engine URL",
                       EXIT_USAGE)
    if interval <= 0 or duration < interval:
        raise CLIError(f"tiderl measure kv: need 0 < --interval ({interval}) <= --duration "
                       f"({duration})", EXIT_USAGE)
    state = _job("kv", job, run_root) if job is not None else None
    output = Output(json_mode)
    try:
        url = (measure.job_metrics_url(state) if state is not None
               else measure.engine_metrics_url(str(engine)))
        result = measure.measure_kv(url, duration, interval, on_start=lambda source: (
            output.note(f"sampling {url} ({source}) every {interval:g} s for {duration:g} s")))
    except measure.MeasureError as exc:
        hint = (f" (is job {state.job_id} still running?)" if state is not None
                and isinstance(exc, measure.EndpointUnreachable) else "")
        raise CLIError(f"tiderl measure kv: {exc}{hint}") from None
    payload = result.to_dict()
    payload["png"] = str(measure.plot_kv(result, out)) if out is not None else None
    output.result(payload, lambda console: _render_kv(console, payload))


@app.command("readiness")
def readiness(
    job: str = typer.Option(..., "--job", help="Job id in runs/."),
    run_root: Path | None = RunRootOpt,
    out: Path | None = typer.Option(None, "--out",
                                    help="PNG of the RAS/TPRM plane (default: RUN/readiness.png)."),
    json_mode: bool = JsonFlag,
) -> None:
    """RAS and TPRM per step: a table and a PNG of the RAS/TPRM plane."""
    from tiderl.launch import measure
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import job_file
    from tiderl.runtime.lineage import EVENTS_FILE, METRICS_FILE, ReportError, read_lineage
    from tiderl.runtime.report import plot_readiness

    state = _job("readiness", job, run_root)
    try:
        for name in (METRICS_FILE, EVENTS_FILE):  # an SSH job's: fetched from its node
            job_file(state, name)
        metrics = read_lineage(Path(state.run_dir)).metrics  # a resume's discarded steps: out
    except (LaunchError, ReportError) as exc:
        raise CLIError(f"tiderl measure readiness: {exc}") from None
    if not metrics:
        raise CLIError(f"tiderl measure readiness: job {state.job_id} has no steps yet")
    path = plot_readiness(metrics, out or Path(state.run_dir) / "readiness.png")
    payload = {"job": state.job_id, "steps": measure.readiness_rows(metrics), "png": str(path)}
    Output(json_mode).result(payload, lambda console: _render_readiness(console, payload))


def _job(command: str, job: str, run_root: Path | None):
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import resolve_job

    try:
        return resolve_job(job, run_root)
    except LaunchError as exc:
        raise CLIError(f"tiderl measure {command}: {exc}") from None


def _render_kv(console: Console, payload: dict) -> None:
    rows = [(s["t_s"], _pct(s["usage"]), _tokens(s), _pct(s["hit_rate"]), s["hit_rate_kind"])
            for s in payload["samples"]]
    columns = ("t (s)", "KV usage", "KV tokens used/capacity", "hit rate", "hit rate kind")
    console.print(table(f"KV cache: {payload['source']} ({payload['url']})", columns, rows))
    if payload["png"]:
        console.print(f"plot: {payload['png']}", markup=False)


def _render_readiness(console: Console, payload: dict) -> None:
    rows = [(s["step"], s["ras"], _num(s["tprm_s"], 3), s["step_mode"], s["num_micro_batches"],
             _num(s["step_s"], 2)) for s in payload["steps"]]
    console.print(table(f"Readiness of job {payload['job']}",
                        ("step", "RAS", "TPRM s", "step_mode", "micro-batches", "step s"), rows))
    console.print(f"plot: {payload['png']}", markup=False)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _tokens(sample: dict) -> str:
    used, capacity = sample["used_tokens"], sample["capacity_tokens"]
    return "" if used is None or capacity is None else f"{used:.0f}/{capacity:.0f}"
