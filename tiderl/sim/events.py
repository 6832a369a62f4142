"""The simulator's event loop: a heap of timed events on a simulated clock (vidur's design).

    at(t, handler, payload) ──push──> heap of (time, seq, handler, payload)
                                        │ pop the earliest (ties: scheduling order)
                                        v
                              now = time; new = handler(payload)
                                        │ handlers schedule more events (at/after) or
                                        └─ return them as (time, handler, payload) tuples

There is no wall clock and no randomness here: the clock only moves to the time of the next
event, and events sharing a time run in the order they were scheduled (``seq``), so a run is a
pure function of its inputs. Cancelling is lazy: a handler that finds its event stale (e.g. an
engine's epoch moved on) simply returns.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

Handler = Callable[[Any], Iterable["Event"] | None]
Event = tuple[float, Handler, Any]


class EventLoop:
    """A discrete-event clock. ``run`` pops events in (time, seq) order until a stop."""

    __slots__ = ("_heap", "_seq", "_stopped", "now")

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[tuple[float, int, Handler, Any]] = []
        self._seq = 0
        self._stopped = False

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def num_events(self) -> int:
        """Events handled so far: every one scheduled and no longer on the heap."""
        return self._seq - len(self._heap)

    def at(self, time: float, handler: Handler, payload: Any = None) -> None:
        """Run ``handler(payload)`` at simulated ``time`` (never before now)."""
        if time < self.now:
            raise ValueError(f"event at {time!r} is before now ({self.now!r})")
        heapq.heappush(self._heap, (time, self._seq, handler, payload))
        self._seq += 1

    def after(self, delay: float, handler: Handler, payload: Any = None) -> None:
        self.at(self.now + delay, handler, payload)

    def stop(self) -> None:
        """End ``run`` after the current handler returns."""
        self._stopped = True

    def run(self, until: float | None = None) -> float:
        """Handle events until ``stop()``, an empty heap or the clock would pass ``until``.

        Returns the clock. Events a handler returns are scheduled like ``at`` calls.
        """
        self._stopped = False
        heap = self._heap
        while heap and not self._stopped:
            if until is not None and heap[0][0] > until:
                self.now = until
                break
            time, _, handler, payload = heapq.heappop(heap)
            self.now = time
            returned = handler(payload)
            if returned:
                for event in returned:
                    self.at(*event)
        return self.now
