"""`tiderl bench ...`: side-by-side benchmarks that write JSON under bench/results/."""

from __future__ import annotations

import typer

from tiderl.cli.errors import not_built

app = typer.Typer(help="Benchmarks, side by side in one run: JSON + table.", no_args_is_help=True)


@app.command("ra2p")
def ra2p() -> None:
    """RA2P modes (colocated, decoupled, vanilla streaming) on local ranks vs the cost model."""
    raise not_built("bench ra2p")


@app.command("ctb")
def ctb() -> None:
    """CTB vs request-level rollout: KV hit rate and generation throughput."""
    raise not_built("bench ctb")


@app.command("engine")
def engine() -> None:
    """Embedded engine decode throughput and prefix reuse."""
    raise not_built("bench engine")


@app.command("e2e")
def e2e() -> None:
    """The same workload under sync, async, stream and tiderl modes: goodput and reward."""
    raise not_built("bench e2e")
