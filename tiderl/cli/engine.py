"""`tiderl engine serve`: run the embedded rollout engine alone behind its HTTP API."""

from __future__ import annotations

from pathlib import Path

import typer

from tiderl.cli.errors import not_built

app = typer.Typer(help="The embedded rollout engine.", no_args_is_help=True)


@app.command("serve")
def serve(
    model: Path = typer.Option(..., "--model", help="HF-format model folder."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    kv_cache_tokens: int = typer.Option(16384, "--kv-cache-tokens", help="KV pool size."),
) -> None:
    """OpenAI-compatible /v1/completions with token ids, /metrics, admin routes."""
    raise not_built("engine serve")
