"""The staleness window CTB's admissions go through (:class:`StalenessWindow`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StalenessWindow:
    """The staleness throttle: non-eval admissions stop at
    ``num_retired + (max_staleness + 1) * tasks_per_step``, where ``num_retired`` counts the
    training tasks already trained or discarded and ``tasks_per_step`` is the global batch. With
    a fixed batch B this is the familiar (version + max_staleness + 1) · B; it follows what was
    really consumed, so rollout never runs further ahead than the staleness bound allows.
    ``tasks_per_step == 0`` disables it."""

    max_staleness: int = 0
    tasks_per_step: int = 0
    num_retired: int = 0
    num_admitted: int = 0  # training tasks admitted (a group's whole count at its probe)

    @property
    def places(self) -> int:
        """The tasks that may be admitted and not yet retired at once (0: unthrottled)."""
        return (self.max_staleness + 1) * self.tasks_per_step

    @property
    def limit(self) -> int | None:
        """How many non-eval tasks may have been admitted in total; None when unthrottled."""
        if self.tasks_per_step == 0:
            return None
        return self.num_retired + self.places
