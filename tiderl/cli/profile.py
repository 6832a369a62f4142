"""`tiderl profile kv|readiness`: KV-cache hit rate and RAS/TPRM of a job or an engine."""

from __future__ import annotations

import typer

from tiderl.cli.errors import not_built

app = typer.Typer(help="Measure a running job or engine: KV cache and readiness.",
                  no_args_is_help=True)


@app.command("kv")
def kv(
    job: str | None = typer.Option(None, "--job", help="Job id in runs/."),
    engine: str | None = typer.Option(None, "--engine",
                                      help="Engine base URL (TideRL, vLLM or SGLang)."),
) -> None:
    """KV-cache hit rate and usage over time, from the engine's Prometheus metrics."""
    raise not_built("profile kv")


@app.command("readiness")
def readiness(job: str = typer.Option(..., "--job", help="Job id in runs/.")) -> None:
    """RAS and TPRM per step: a table and a PNG of the RAS/TPRM plane."""
    raise not_built("profile readiness")
