"""Runs of an experiment as a list known in advance, so that a caller can say what is running.

An experiment (or a policy comparison, or a sweep) names every simulation it needs before it
starts the first one, then runs them through :func:`run_all`; ``progress`` hears of each run as it
starts: its label, its number and how many there are. The simulator never prints or reads the
wall clock: the CLI's callback does both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

Progress = Callable[[str, int, int], None]  # (label of the run starting, its number, of N)


def run_all(runs: dict[str, Callable[[], T]], progress: Progress | None = None) -> dict[str, T]:
    """Each run in order, by label; ``progress(label, n, N)`` before run n (1-based) of N."""
    results: dict[str, T] = {}
    for number, (label, run) in enumerate(runs.items(), start=1):
        if progress is not None:
            progress(label, number, len(runs))
        results[label] = run()
    return results
