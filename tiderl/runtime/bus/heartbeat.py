"""Heartbeat bookkeeping: which ranks have gone quiet. Pure: time comes in as ``now``.

A rank is declared dead when more than ``interval_s * misses`` seconds have passed since its last
beat. :meth:`HeartbeatMonitor.dead` reports each death once; a rank that beats again is revived
and can die (and be reported) again. The coordinator logs deaths and keeps running.
"""

from __future__ import annotations

from tiderl.core.config import require_int, require_positive


class HeartbeatMonitor:
    """Last beat per rank and which ranks are currently declared dead."""

    def __init__(self, interval_s: float, misses: int) -> None:
        require_positive(interval_s, "heartbeat_s")
        require_int(misses, "heartbeat_misses", 1)
        self.timeout_s = interval_s * misses
        self._last_beat: dict[int, float] = {}
        self._dead: set[int] = set()

    def beat(self, rank: int, now: float) -> bool:
        """Record a beat (the first one registers the rank); True if the rank was dead."""
        self._last_beat[rank] = now
        if rank in self._dead:
            self._dead.discard(rank)
            return True
        return False

    def dead(self, now: float) -> list[int]:
        """Ranks newly silent for longer than the timeout, sorted; each reported once."""
        newly = sorted(rank for rank, last in self._last_beat.items()
                       if rank not in self._dead and now - last > self.timeout_s)
        self._dead.update(newly)
        return newly

    def alive(self) -> list[int]:
        """Registered ranks not declared dead (as of the last :meth:`dead` call), sorted."""
        return sorted(rank for rank in self._last_beat if rank not in self._dead)
