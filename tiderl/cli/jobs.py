"""Job control: `tiderl status`, `tiderl logs`, `tiderl stop` (they read runs/<job>/)."""

from __future__ import annotations

import typer

from tiderl.cli.errors import not_built
from tiderl.cli.output import JsonFlag


def status(
    job: str | None = typer.Argument(None, help="Job id; omit for every job in runs/."),
    json_mode: bool = JsonFlag,
) -> None:
    """Show the processes of a job and whether they are alive."""
    raise not_built("status")


def logs(
    job: str = typer.Argument(..., help="Job id."),
    rank: int | None = typer.Option(None, "--rank", help="Only this rank's log."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
) -> None:
    """Print a job's logs."""
    raise not_built("logs")


def stop(job: str = typer.Argument(..., help="Job id.")) -> None:
    """Stop every process of a job (SIGTERM, then SIGKILL after a grace period)."""
    raise not_built("stop")
