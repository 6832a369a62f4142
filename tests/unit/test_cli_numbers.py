"""Every int and float option of every command is declared with bounds (tiderl.cli.options), so
the parser refuses a number past them before the command runs. The CLI itself, run on huge,
negative and non-numeric values, is in tests/integration/test_cli.py."""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterator
from typing import Any

import typer

from tiderl.cli.main import app
from tiderl.cli.options import MAX_COUNT, MAX_PORT, MAX_SECONDS, MAX_SEED


def number_options(command: Any, path: str) -> Iterator[tuple[str, str, type, Any]]:
    """(command path, option, int or float, its declared parameter info) of every numeric
    option. Typer vendors its own click: a parameter says what it is by its type descriptor."""
    for param in command.params:
        annotation = param.type_descriptor.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        if annotation in (int, float):
            yield path, param.opts[0], annotation, param.type_descriptor.parameter_info
    for name, sub in getattr(command, "commands", {}).items():
        yield from number_options(sub, f"{path} {name}")


OPTIONS = list(number_options(typer.main.get_command(app), "tiderl"))


def test_every_number_option_has_finite_bounds_within_what_the_job_carries():
    assert len(OPTIONS) >= 18  # rebalance's counts and timeout, the ports, steps, seeds, ...
    for path, option, kind, info in OPTIONS:
        where = f"{path} {option}"
        assert info.min is not None and info.max is not None, where
        assert math.isfinite(info.min) and info.min >= 0, where
        limit = {int: max(MAX_COUNT, MAX_PORT, MAX_SEED), float: MAX_SECONDS}[kind]
        assert info.min <= info.max <= limit, where


def test_the_rank_counts_of_rebalance_are_counts():
    bounds = {(path, option): (info.min, info.max) for path, option, _, info in OPTIONS}
    assert bounds[("tiderl rebalance", "--rollout")] == (0, MAX_COUNT)
    assert bounds[("tiderl rebalance", "--trainer")] == (0, MAX_COUNT)
    assert bounds[("tiderl env serve", "--port")] == (1, MAX_PORT)
    assert bounds[("tiderl model init", "--seed")] == (0, MAX_SEED)
