"""Options that several commands share: the profile every daemon and job reads, and the bounded
numbers every int and float option is declared with.

The parser checks a number against its bounds before the command runs (exit 2, one line naming
the option), so no command, job file or bus message ever sees a count past an int32, a
negative index, or a time that is not a finite number of seconds (``nan``, ``inf``, ``1e400``).
"""

from __future__ import annotations

from typing import Any

import typer

# tiderl.profile.DEFAULT_PROFILE, written out so that --help imports no profile code
ProfileOpt = typer.Option("local", "--profile", "-p",
                          help="Profile name in profiles/ or a path to a YAML file.")
SetOpt = typer.Option(None, "--set", "-s", metavar="KEY=VALUE",
                      help="Override one profile value, e.g. ctb.budget_fraction=0.8 or a list, "
                           "'logging.backends=[jsonl,tensorboard]' (repeatable).")

MAX_COUNT = 2**31 - 1  # ranks, steps, sessions, turns: what an int32 holds
MAX_SEED = 2**32 - 1  # the seeds torch and numpy take alike
MAX_SECONDS = 365 * 24 * 3600.0  # a timeout, a grace period or a TTL: a year at most
MAX_PORT = 65535


def count_option(default: int | None, name: str, *, minimum: int = 0,
                 maximum: int = MAX_COUNT, help: str | None = None) -> Any:
    """An int option (a count, an index, a seed) in ``minimum..maximum``."""
    return typer.Option(default, name, min=minimum, max=maximum, help=help)


def seconds_option(default: float, name: str, *, minimum: float = 0.0,
                   help: str | None = None) -> Any:
    """A float option of seconds, finite, in ``minimum..MAX_SECONDS``."""
    return typer.Option(default, name, min=minimum, max=MAX_SECONDS, help=help)


def port_option(default: int) -> Any:
    """``--port``: a TCP port to listen on."""
    return typer.Option(default, "--port", min=1, max=MAX_PORT)
