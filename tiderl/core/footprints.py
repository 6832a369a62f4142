"""What CTB estimates a task's KV footprint at, from what the book measured.

Three estimates, each a moving mean over about the last ``FOOTPRINT_WINDOW`` samples:

- a NEW task's footprint before its group's probe reported: its environment's mean probed first
  turn (``default_tokens`` before any probe of it reported);
- F, what an admitted task's footprint grows to: the mean last footprint of the tasks that
  finished; before any finished, ``default_tokens`` or, where lower, the growth bound: per
  environment, the mean first turn plus the mean growth per turn up to its turn limit.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add, mul, sub

FOOTPRINT_WINDOW = 256  # tasks a footprint estimate averages over (a moving mean)


@dataclass(slots=True)
class MovingMean:
    """The mean of the values added, over about the last ``FOOTPRINT_WINDOW`` of them (exact
    while fewer were added)."""

    value: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) / min(self.count, FOOTPRINT_WINDOW)


def projected_peak(footprints: Sequence[int], final: float) -> float:
    """The most KV a rank's active tasks will hold if each grows at the same pace until its
    footprint reaches ``final`` and then finishes; ``footprints`` sorted ascending.

    Once each task has grown by x tokens, the tasks still there are those with f + x <= final,
    holding the sum of f + x. That is largest now (x = 0: the usage) or just as the j-th smallest
    task reaches ``final`` (x = final - f_j, the j smallest left): f_1 + ... + f_j
    + j * (final - f_j). Tasks of one age peak together at n * final; tasks spread evenly over
    their lives peak about now. A task at or past ``final`` counts now only.
    """
    below = footprints[:bisect_left(footprints, final)]
    now = sum(footprints)
    if not below:
        return now
    counts = range(1, len(below) + 1)
    grown = map(add, map(sub, accumulate(below), map(mul, counts, below)),
                map(mul, counts, repeat(final)))
    return max(now, max(grown))


@dataclass(slots=True)
class FootprintModel:
    """The book's footprint estimates; the book feeds it a task's turn limit when it is added,
    its turns' footprints as they are reported, its probe's first turn and its last footprint."""

    default_tokens: int = 512
    bounds_growth: bool = True  # F before any finish: the growth bound where below the default
    finished: MovingMean = field(default_factory=MovingMean)  # finished tasks' last footprints
    # per environment, its probes' first-turn footprints (what its unprobed tasks are admitted at)
    first_turns: dict[str, MovingMean] = field(default_factory=dict)
    # per environment, its tasks' turn limit (None: some task's is not known) and, until a task
    # finished, their footprints' growth per turn
    turn_limits: dict[str, int | None] = field(default_factory=dict)
    growth: dict[str, MovingMean] = field(default_factory=dict)

    # ------------------------------------------------------------------ estimates

    @property
    def num_finished(self) -> int:
        return self.finished.count

    def first_turn(self, env: str) -> int:
        """What a task of ``env`` with no hint is admitted at before its group's probe reports:
        the mean first-turn footprint of that environment's recent probes (``default_tokens``
        before any reported). No fixed default suits every workload: on ``bench e2e``'s text
        workload first turns measure 44 tokens (guess) and 70 (shop), and at 512 a rank admits
        a seventh of the probes it has room for."""
        probes = self.first_turns.get(env)
        return max(1, round(probes.value)) if probes else self.default_tokens

    def expected(self) -> float:
        """F: the mean last footprint of the tasks that finished recently; before any did,
        ``default_tokens`` or the growth bound where that is lower."""
        finished = self.finished
        if finished.count:
            return finished.value
        bound = self.growth_bound() if self.bounds_growth else None
        return float(self.default_tokens) if bound is None else min(self.default_tokens, bound)

    def is_measured(self) -> bool:
        """Whether F rests on measurements: some task finished, or the growth bound is what F is
        (every environment's first turn and growth measured, the bound below the default)."""
        if self.finished.count:
            return True
        if not self.bounds_growth:
            return False
        bound = self.growth_bound()
        return bound is not None and bound <= self.default_tokens

    def growth_bound(self) -> float | None:
        """Before any task finished, the most a task's footprint grows to, projected from what
        was measured: per environment, its mean probed first turn plus its mean growth per turn
        for every turn after the first up to its turn limit, the largest over the environments;
        None while some environment lacks one of the three. It bounds F where episodes end at
        their limit or before it. On ``bench e2e``'s text workload (8 turns) it is about
        44 + 7 x 25 tokens (guess) and 70 + 7 x 30 (shop), where every task ends at 219 and 280
        and the default 512 holds a rank to half the tasks it has room for."""
        bound = 0.0
        for env, limit in self.turn_limits.items():
            first, growth = self.first_turns.get(env), self.growth.get(env)
            if limit is None or first is None or growth is None:
                return None
            bound = max(bound, first.value + growth.value * (limit - 1))
        return bound or None

    # ------------------------------------------------------------------ samples

    def task_added(self, env: str, max_turns: int | None) -> None:
        """A task of ``env`` whose episode runs at most ``max_turns`` (None: not known)."""
        limit = self.turn_limits.get(env, max_turns)
        self.turn_limits[env] = (None if limit is None or max_turns is None
                                 else max(limit, max_turns))

    def turn_reported(self, env: str, last: int, footprint: int) -> None:
        """A task's turn after its first grew its footprint from ``last`` to ``footprint`` (the
        book reports these only until a task finished: then F is measured)."""
        self.growth.setdefault(env, MovingMean()).add(footprint - last)

    def probe_reported(self, env: str, footprint: int) -> None:
        self.first_turns.setdefault(env, MovingMean()).add(footprint)

    def task_finished(self, footprint: int) -> None:
        self.finished.add(footprint)
