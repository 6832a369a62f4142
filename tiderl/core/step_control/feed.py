"""The training feed: groups go out up to CTB's staleness throttle, and each is counted where it
is until it trains or is dropped.

    admission limit L (TaskBook.train_admission_limit: retired tasks + (max_staleness + 1)
    batches) ──due(L)──> groups g{num_fed} .. g{ceil(L / G) - 1}, now out ──back(g)──> ready,
    failed (a task produced no turn) or, from the buffer, stale; trained with their step
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.commands import GroupSpec
from tiderl.core.step_control.state import GroupCount


def training_group_id(index: int) -> str:
    """The id of the ``index``-th training group fed (what ``trained`` events name): g0, g1, ..."""
    return f"g{index}"


@dataclass
class TrainingFeed:
    group_size: int
    num_fed: int = 0
    out: dict[str, GroupSpec] = field(default_factory=dict)  # fed, not back yet
    count: GroupCount = field(default_factory=GroupCount)

    @property
    def failed_samples(self) -> int:
        return self.count.failed * self.group_size

    def due(self, limit: int | None, step: int) -> tuple[GroupSpec, ...]:
        """The groups the throttle's ``limit`` (tasks; None: none fed) lets out now, counted
        as fed for step ``step``."""
        horizon = -(-limit // self.group_size) if limit is not None else 0
        specs = tuple(GroupSpec(training_group_id(i), i, False, step)
                      for i in range(self.num_fed, horizon))
        for spec in specs:
            self.out[spec.group_id] = spec
        self.num_fed += len(specs)
        self.count.fed += len(specs)
        return specs

    def back(self, group_id: str, is_trainable: bool) -> None:
        """Every task of ``group_id`` finished: it is ready, or failed (a task played no turn)."""
        self.out.pop(group_id, None)
        if is_trainable:
            self.count.ready += 1
        else:
            self.count.failed += 1
