"""`tiderl model init`: a seeded random checkpoint and tokenizer for CPU runs."""

from __future__ import annotations

from pathlib import Path

import typer

from tiderl.cli.errors import not_built

app = typer.Typer(help="Local model checkpoints.", no_args_is_help=True)


@app.command("init")
def init(
    size: str = typer.Option("tiny", "--size", help="tiny or small."),
    out: Path = typer.Option(..., "--out", help="Output folder."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Write config.json, model.safetensors and tokenizer.json for a random-init model."""
    raise not_built("model init")
