"""`tiderl rebalance`: a manual ERS plan sent over the bus, applied at the next sync boundary."""

from __future__ import annotations

import typer

from tiderl.cli.errors import not_built


def rebalance(
    job: str = typer.Argument(..., help="Job id."),
    rollout: int = typer.Option(..., "--rollout", help="Rollout ranks after the move."),
    trainer: int = typer.Option(..., "--trainer", help="Trainer ranks after the move."),
    mode: str | None = typer.Option(None, "--mode", help="RA2P mode: decoupled or colocated."),
) -> None:
    """Move ranks between rollout and training by hand."""
    raise not_built("rebalance")
