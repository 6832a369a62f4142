"""Runs of an experiment as a list known in advance, so that a caller can say what is running,
and can run them side by side.

An experiment (or a policy comparison, or a sweep) names every simulation it needs before it
starts the first one, then runs them through :func:`run_all`; ``progress`` hears of each run as it
starts: its label, its number and how many there are. The simulator never prints or reads the
wall clock: the CLI's callback does both.

Each run is an independent, seeded simulation, so runs may go in worker processes: inside
``with workers(n):`` :func:`run_all` runs up to ``n`` at once (``tiderl sim --jobs``), with the
same results as one after the other. Workers come from a fork server that has imported the
simulator once (a fork of a process with threads, as a test runner's, is not safe).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")

Progress = Callable[[str, int, int], None]  # (label of the run starting, its number, of N)

_workers = 1  # runs at once in run_all (set by ``workers``)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextlib.contextmanager
def workers(num: int) -> Iterator[None]:
    """Within it, :func:`run_all` runs up to ``num`` simulations at once (1: in this process)."""
    global _workers
    if num < 1:
        raise ValueError(f"workers must be >= 1, got {num!r}")
    saved, _workers = _workers, num
    try:
        yield
    finally:
        _workers = saved


def run_all(runs: dict[str, Callable[[], T]], progress: Progress | None = None) -> dict[str, T]:
    """Each run, by label, in order (up to ``workers`` at once, started in order);
    ``progress(label, n, N)`` as run n (1-based) of N starts."""
    labels = list(runs)
    if _workers == 1 or len(runs) == 1:
        results: dict[str, T] = {}
        for number, label in enumerate(labels, start=1):
            if progress is not None:
                progress(label, number, len(runs))
            results[label] = runs[label]()
        return results
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tiderl.sim.cluster", "tiderl.sim.experiments"])
    done: dict[str, T] = {}
    with ProcessPoolExecutor(min(_workers, len(runs)), mp_context=context) as pool:
        pending, started = {}, 0
        while started < len(labels) or pending:
            while started < len(labels) and len(pending) < _workers:
                label = labels[started]
                started += 1
                if progress is not None:
                    progress(label, started, len(runs))
                pending[pool.submit(runs[label])] = label
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                done[pending.pop(future)] = future.result()
    return {label: done[label] for label in labels}
