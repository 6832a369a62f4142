"""`tiderl sim`: simulated cluster experiments driving the core policies."""

from __future__ import annotations

import typer

from tiderl.cli.errors import not_built


def sim(
    profile: str = typer.Argument(..., help="A profile under profiles/sim/ or a path."),
    policies: str = typer.Option("verl,areal,streamrl,tiderl", "--policies",
                                 help="Comma-separated policies to compare."),
) -> None:
    """Simulate a cluster run of each policy and compare goodput."""
    raise not_built("sim")
