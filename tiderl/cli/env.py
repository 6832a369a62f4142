"""`tiderl env serve`: run the environment service alone."""

from __future__ import annotations

import typer

from tiderl.cli.errors import not_built

app = typer.Typer(help="The environment service.", no_args_is_help=True)


@app.command("serve")
def serve(
    envs: str = typer.Option("guess,shop,household", "--envs", help="Environments to serve."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8100, "--port"),
) -> None:
    """Serve /start /observation /end /pause /resume over HTTP."""
    raise not_built("env serve")
