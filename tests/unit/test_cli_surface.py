"""The user-facing surface is frozen: every command, its arguments and options, and every profile
key (with the old names still read) are listed in ``cli_surface.txt`` beside this test, which
compares the code against it. A change to the surface fails here until the list is updated with
it (``python -m tests.unit.test_cli_surface --write``), so each one is deliberate, and shows in
review next to the docs that describe it."""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from tiderl.cli.main import app
from tiderl.profile import Profile
from tiderl.profile.aliases import ALIASES, SAMPLE_ALIASES

SURFACE = Path(__file__).with_name("cli_surface.txt")
HEADER = ("# The frozen CLI and profile surface (tests/unit/test_cli_surface.py). Update it only\n"
          "# with a deliberate change, and the docs that describe it, in the same commit.\n")


def commands(command: Any, path: str) -> Iterator[str]:
    """A command's lines and its subcommands'. Typer vendors its own click, so its classes are
    told apart by what they say they are, not by isinstance."""
    hidden = " (hidden)" if command.hidden else ""
    yield f"command {path}{hidden}"
    for param in command.params:
        if param.param_type_name == "argument":
            yield f"  argument {param.name}"
        elif param.param_type_name == "option" and param.name != "help":
            yield f"  option {' '.join([*param.opts, *param.secondary_opts])}"
    for name in sorted(getattr(command, "commands", {})):
        yield from commands(command.commands[name], f"{path} {name}")


def profile_keys(cls: type, prefix: str) -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key, tp = f"{prefix}{field.name}", hints[field.name]
        if dataclasses.is_dataclass(tp):
            yield from profile_keys(tp, f"{key}.")
        else:
            yield f"key {key}"


def surface() -> str:
    lines = [*commands(typer.main.get_command(app), "tiderl"), *profile_keys(Profile, "")]
    lines += [f"old key {old} -> {new}" for old, new in {**ALIASES, **SAMPLE_ALIASES}.items()]
    return HEADER + "\n".join(lines) + "\n"


def test_the_surface_is_the_listed_one():
    listed, current = SURFACE.read_text(), surface()
    added = sorted(set(current.splitlines()) - set(listed.splitlines()))
    removed = sorted(set(listed.splitlines()) - set(current.splitlines()))
    assert listed == current, (
        f"the CLI or profile surface changed (added: {added}; removed: {removed}; or reordered):"
        " if deliberate, run `python -m tests.unit.test_cli_surface --write`, update the docs "
        "and commit both")


def test_the_listing_sees_commands_options_and_keys():
    """The extraction itself: a group's commands, hidden ones marked, options with their short
    forms and aliases, nested profile keys, the old names."""
    lines = surface().splitlines()
    assert "command tiderl launch" in lines and "  option --profile -p" in lines
    assert "command tiderl measure kv" in lines and "command tiderl profile (hidden)" in lines
    assert "key job.steps" in lines and "key ctb.weights.eval" in lines
    assert "  option --placement --mode" in lines  # tiderl rebalance's old name, kept
    assert "old key runtime.mode -> runtime.system" in lines


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SURFACE.write_text(surface())
    print(f"wrote {SURFACE}")
