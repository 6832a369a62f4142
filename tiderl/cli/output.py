"""The one object through which the CLI prints: rich for people, ``--json`` for scripts.

Library code never prints; commands hand their result to :class:`Output`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tiderl.core.quote import one_line

JsonFlag = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")


class Output:
    def __init__(self, json_mode: bool = False):
        self.json_mode = json_mode
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.err_console = Console(file=sys.stderr, highlight=False, soft_wrap=True)

    def result(self, payload: Any, render: Callable[[Console], None] | None = None) -> None:
        """The command's result: JSON of ``payload``, or ``render`` (default: pretty data)."""
        if self.json_mode:
            sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        elif render is not None:
            render(self.console)
        else:
            self.console.print_json(data=payload, default=str)

    def note(self, message: str) -> None:
        """A human-facing status line on stderr (kept out of JSON on stdout)."""
        self.err_console.print(message, markup=False)

    @staticmethod
    def error(message: str) -> None:
        """``error: <message>``, one line of bounded length whatever the message quotes (the
        last guard: each error path cuts its own values, :mod:`tiderl.core.quote`)."""
        sys.stderr.write(f"error: {one_line(message)}\n")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
          keep: Sequence[str] = ()) -> Table:
    """A table of data (never rich markup); the columns named in ``keep`` are never cut or
    wrapped (the others give way on a narrow terminal)."""
    out = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        if column in keep:
            widest = max((len(str(row[i])) for row in rows), default=0)
            out.add_column(column, no_wrap=True, min_width=max(widest, len(column)))
        else:
            out.add_column(column)
    for row in rows:
        out.add_row(*(Text("" if v is None else str(v)) for v in row))  # data, not markup
    return out
