"""Evaluation phases: ``num_groups`` groups every ``every`` steps (step 0 included; 0: none).

Evaluation groups go out beside the staleness throttle, run on the version anchored when they
start (paper Table 1: their engines take no new weights meanwhile) and are never trained; the
step cycle holds the post-update boundary of a step that ends while they are out
(``Hold.EVALUATION``) and lends them rollout ranks through ERS (``phase_tasks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.commands import GroupSpec


@dataclass
class Evaluation:
    """Which groups are out, and the last step whose groups were fed."""

    every: int
    num_groups: int
    group_size: int  # tasks per evaluation group
    in_flight: set[str] = field(default_factory=set)
    fed_at: int = -1

    def is_due(self, step: int) -> bool:
        """Step ``step`` starts an evaluation not fed yet (its groups go out when it opens)."""
        return bool(self.every and self.num_groups and step % self.every == 0
                    and self.fed_at != step)

    def is_phase(self, step: int) -> bool:
        return self.is_due(step) or bool(self.in_flight)

    def num_unfinished_tasks(self, step: int) -> int:
        """Tasks the phase still has to run: those of the groups out, and of those due at
        ``step``."""
        groups = len(self.in_flight) + (self.num_groups if self.is_due(step) else 0)
        return groups * self.group_size

    def feed(self, step: int) -> tuple[GroupSpec, ...]:
        """Step ``step``'s groups, now out (none unless due)."""
        if not self.is_due(step):
            return ()
        self.fed_at = step
        specs = tuple(GroupSpec(f"e{step}.{i}", i, True, step) for i in range(self.num_groups))
        self.in_flight.update(spec.group_id for spec in specs)
        return specs

    def finish(self, group_id: str) -> bool:
        """True when ``group_id`` was the phase's last group out."""
        self.in_flight.discard(group_id)
        return not self.in_flight
