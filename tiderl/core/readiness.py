"""Readiness signals of the global buffer (paper §5, App. A): RAS, TPRM, HoL latency, volume.

A *ready time* is when one micro-batch (the unit RAS counts) became ready in the buffer. Times are
seconds on whatever clock the caller runs (simulated or wall); they only enter as arguments.
With ``a_i`` the sorted ready times relative to the step start:

    RAS  N0   = #{i : a_i <= 0}                           ready at the step start
    TPRM      = mean of the post-start gaps a_i - a_{i-1}, i > N0 + 1   (None without a gap)
    HoL       = now - the oldest ready time still in the buffer        (0 when empty)

``readiness_signals`` computes them from one list of ready times when nothing has been consumed
yet; ``ReadinessTracker`` keeps the buffer (ready and consumed events) across steps.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import pairwise

from tiderl.core.types import ReadinessSignals


def relative_ready_times(ready_times: Iterable[float], step_start: float) -> list[float]:
    """The ``a_i`` of App. A: ready times minus the step start, sorted ascending."""
    return sorted(t - step_start for t in ready_times)


def num_ready_at_start(ready_times: Iterable[float], step_start: float) -> int:
    """RAS (N0): how many micro-batches were ready at the step start (``a_i <= 0``)."""
    return sum(1 for t in ready_times if t <= step_start)


def post_start_gaps(ready_times: Iterable[float], step_start: float) -> list[float]:
    """The gaps ``a_i - a_{i-1}`` for ``i > N0 + 1``: between consecutive post-start arrivals.

    The first post-start arrival opens no gap (its distance to the start is ``δ_{N0+1}`` in C_dec,
    not a TPRM sample).
    """
    after = sorted(t for t in ready_times if t > step_start)
    return [later - earlier for earlier, later in pairwise(after)]


def mean_post_start_gap(ready_times: Iterable[float], step_start: float) -> float | None:
    """TPRM: the mean post-start gap, or None with fewer than two post-start arrivals."""
    gaps = post_start_gaps(ready_times, step_start)
    return sum(gaps) / len(gaps) if gaps else None


def hol_latency(buffered_times: Iterable[float], now: float) -> float:
    """Head-of-line latency: age of the oldest buffered micro-batch; 0 for an empty buffer."""
    oldest = min(buffered_times, default=None)
    return 0.0 if oldest is None else max(0.0, now - oldest)


def readiness_signals(
    ready_times: Iterable[float],
    step_start: float,
    now: float,
    *,
    samples_per_mb: int = 1,
    tokens_per_mb: int = 0,
) -> ReadinessSignals:
    """Signals at ``now`` for micro-batches that are all still in the buffer.

    Ready times after ``now`` have not happened yet and are ignored. Volume and tokens count
    ``samples_per_mb`` / ``tokens_per_mb`` per ready micro-batch; use ``ReadinessTracker`` when
    micro-batches differ or some were consumed.
    """
    known = [t for t in ready_times if t <= now]
    return ReadinessSignals(
        ras=num_ready_at_start(known, step_start),
        tprm_s=mean_post_start_gap(known, step_start),
        hol_latency_s=hol_latency(known, now),
        ready_volume=len(known) * samples_per_mb,
        ready_tokens=len(known) * tokens_per_mb,
    )


@dataclass(frozen=True, slots=True)
class _ReadyEntry:
    time: float
    num_samples: int
    num_tokens: int


class ReadinessTracker:
    """The buffer's ready and consumed events, fed with explicit times; no clock inside.

    ``start_step(t)`` opens a step: the micro-batches buffered then are its RAS, and later arrivals
    are its post-start arrivals. ``signals(now)`` is the view ERS needs at a post-update boundary,
    i.e. for a step that would start at ``now``: RAS, HoL, volume and tokens of the buffer at
    ``now``; TPRM from the arrivals since the last ``start_step`` (the latest estimate).
    """

    def __init__(self, step_start: float = 0.0) -> None:
        self._buffered: dict[Hashable, _ReadyEntry] = {}
        self._step_start = step_start
        self._step_times: list[float] = []

    @property
    def step_start(self) -> float:
        return self._step_start

    @property
    def step_ras(self) -> int:
        """RAS of the current step: micro-batches ready at its start."""
        return num_ready_at_start(self._step_times, self._step_start)

    @property
    def num_buffered(self) -> int:
        return len(self._buffered)

    def record_ready(
        self, key: Hashable, time: float, num_samples: int = 1, num_tokens: int = 0
    ) -> None:
        """A micro-batch ``key`` became ready at ``time`` holding these samples and tokens."""
        if key in self._buffered:
            raise ValueError(f"micro-batch {key!r} is already in the buffer")
        if num_samples < 0 or num_tokens < 0:
            raise ValueError(f"negative size for {key!r}: {num_samples} samples, {num_tokens}")
        self._buffered[key] = _ReadyEntry(time, num_samples, num_tokens)
        self._step_times.append(time)

    def record_consumed(self, key: Hashable) -> None:
        """The trainer took micro-batch ``key`` out of the buffer."""
        if key not in self._buffered:
            raise KeyError(f"micro-batch {key!r} is not in the buffer")
        del self._buffered[key]

    def start_step(self, step_start: float) -> None:
        """Open a step at ``step_start``: its ready times are the buffer's, then new arrivals."""
        self._step_start = step_start
        self._step_times = [e.time for e in self._buffered.values()]

    def step_ready_times(self) -> list[float]:
        """This step's ready times relative to its start, sorted (the input of the cost models)."""
        return relative_ready_times(self._step_times, self._step_start)

    def signals(self, now: float) -> ReadinessSignals:
        entries = [e for e in self._buffered.values() if e.time <= now]
        times = [e.time for e in entries]
        arrived = [t for t in self._step_times if t <= now]
        return ReadinessSignals(
            ras=len(entries),
            tprm_s=mean_post_start_gap(arrived, self._step_start),
            hol_latency_s=hol_latency(times, now),
            ready_volume=sum(e.num_samples for e in entries),
            ready_tokens=sum(e.num_tokens for e in entries),
        )
