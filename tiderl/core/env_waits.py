"""How long each environment takes to answer an action, and what a task that has waited so long
can expect to wait more: CTB's release weighs that against recomputing the task's context
(:mod:`tiderl.core.ctb`)."""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from itertools import accumulate

WAIT_WINDOW = 64  # waits per environment that the expected wait is read from


class WaitSamples:
    """One environment's last ``WAIT_WINDOW`` waits (seconds from a generation's end to its
    observation), and what a task that has waited ``age`` seconds can expect to wait more."""

    __slots__ = ("_sorted", "_suffix", "waits")

    def __init__(self) -> None:
        self.waits: deque[float] = deque(maxlen=WAIT_WINDOW)
        self._sorted: list[float] | None = None  # with suffix sums, rebuilt after an add
        self._suffix: list[float] = []

    def add(self, wait_s: float) -> None:
        self.waits.append(wait_s)
        self._sorted = None

    def __eq__(self, other: object) -> bool:  # the samples; the sorted copy is a cache
        return isinstance(other, WaitSamples) and self.waits == other.waits

    __hash__ = None  # mutable

    def remaining(self, age: float) -> float:
        """E[W - age | W > age] over the samples: waits are heavy-tailed (a tool that has run
        long tends to run longer), so the mean alone under-reads an old wait. With no sample
        longer than ``age``, the mean wait (memoryless)."""
        if self._sorted is None:
            self._sorted = sorted(self.waits)
            self._suffix = list(accumulate(reversed(self._sorted)))[::-1]
        waits, n = self._sorted, len(self._sorted)
        i = bisect_right(waits, age)
        if i == n:
            return self._suffix[0] / n
        return self._suffix[i] / (n - i) - age
