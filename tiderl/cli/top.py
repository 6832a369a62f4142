"""`tiderl top`: a live terminal view of a running job, fed by the coordinator's PUB socket."""

from __future__ import annotations

import typer

from tiderl.cli.errors import not_built


def top(
    job: str | None = typer.Option(None, "--job", help="Job id in runs/."),
    bus: str | None = typer.Option(None, "--bus", help="Coordinator PUB address, e.g. tcp://..."),
) -> None:
    """Live view: ranks and roles, token budgets, RA2P mode, RAS/TPRM, goodput."""
    raise not_built("top")
