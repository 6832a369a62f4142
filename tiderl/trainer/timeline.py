"""A per-rank record of what ran when: ref and actor passes, swaps, waits, optimizer steps.

Times are seconds since the step start, read from the wall clock (``time.time``), which every
process on a machine shares, so timelines of several ranks line up on one axis.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Event:
    rank: int
    name: str  # ref_forward | actor_forward | actor_backward | swap | wait | optimizer_step
    start: float
    end: float
    mb_ids: tuple[int, ...] = ()
    note: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    rank: int
    origin: float = 0.0  # wall-clock time of the step start
    events: list[Event] = field(default_factory=list)

    def start_step(self, origin: float) -> None:
        self.origin = origin
        self.events.clear()

    def now(self) -> float:
        return time.time() - self.origin

    @contextlib.contextmanager
    def span(self, name: str, mb_ids: tuple[int, ...] = (), note: str = "") -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.events.append(Event(self.rank, name, start, self.now(), mb_ids, note))

    def as_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.events]

