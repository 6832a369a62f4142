"""What became of each training group of a run, read from its run folder's live lineage.

The guarantee a job keeps through faults and resumes (docs/runtime.md, "Faults and resume"):
no group is trained twice and none is skipped; each is

    trained     in one step (a ``trained`` event names the step's groups)
    dropped     stale or failed, and counted (a ``dropped_group`` event with its reason)
    left over   buffered or rolling out when the job stopped

:func:`group_fates` reads that from the files alone (:func:`.lineage.read_lineage`: what a
resume discarded does not count), and :meth:`GroupFates.problems` names each breach: a group
trained twice, trained and dropped, or counts that disagree with the ``stop`` event's. The
chaos tests end with it; a soak benchmark can too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from tiderl.core.step_control.feed import training_group_id
from tiderl.runtime.lineage import Row, read_lineage


class Fate(str, Enum):
    TRAINED = "trained"
    DROPPED = "dropped"
    LEFT_OVER = "left over"  # buffered or rolling out when the job stopped


@dataclass
class GroupFate:
    """One group's: the steps that trained it (more than one: trained twice) and, dropped, why
    (both: a breach)."""

    steps: list[int] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # the drop reasons (stale, no turn, ...)

    @property
    def fate(self) -> Fate:
        return Fate.TRAINED if self.steps else Fate.DROPPED if self.dropped else Fate.LEFT_OVER


@dataclass(frozen=True)
class GroupFates:
    """Every training group the live lineage knows: those fed (the ``stop`` event's count),
    or without a stop event (a killed job) those its events name."""

    groups: dict[str, GroupFate]
    counts: dict[str, int]  # the last stop event's group counts ({}: no stop event)

    def of(self, fate: Fate) -> list[str]:
        return [group for group, seen in self.groups.items() if seen.fate is fate]

    @property
    def trained_twice(self) -> dict[str, list[int]]:
        return {group: seen.steps for group, seen in self.groups.items() if len(seen.steps) > 1}

    def problems(self) -> list[str]:
        """One line per breach of the guarantee ([] when it holds)."""
        lines = [f"{group} trained in steps {steps}" for group, steps in self.trained_twice.items()]
        lines += [f"{group} trained in step {seen.steps[0]} and dropped ({seen.dropped[0]})"
                  for group, seen in self.groups.items() if seen.steps and seen.dropped]
        return lines + self._count_problems() if self.counts else lines

    def _count_problems(self) -> list[str]:
        """Groups the events name that were never fed; fates whose number is not the stop
        event's count."""
        fed = {training_group_id(i) for i in range(self.counts.get("fed", 0))}
        lines = [f"{group} is in the events, not among the {len(fed)} groups fed"
                 for group in self.groups if group not in fed]
        left = self.counts.get("buffered", 0) + self.counts.get("rolling_out", 0)
        for fate, counted in ((Fate.TRAINED, self.counts.get("trained")),
                              (Fate.DROPPED, self.counts.get("dropped")), (Fate.LEFT_OVER, left)):
            found = len(self.of(fate))
            if found != counted:
                lines.append(f"{found} groups {fate.value} in the events, the stop event counts "
                             f"{counted}")
        return lines


def group_fates(run_dir: Path) -> GroupFates:
    """Each training group's fate in ``run_dir``'s live lineage."""
    return fates_of(read_lineage(run_dir).events)


def fates_of(events: list[Row]) -> GroupFates:
    """Each training group's fate from a live lineage's events."""
    stops = [e for e in events if e.get("kind") == "stop"]
    counts = dict(stops[-1].get("groups") or {}) if stops else {}
    groups: dict[str, GroupFate] = {training_group_id(i): GroupFate()
                                    for i in range(counts.get("fed", 0))}
    for event in events:
        kind = event.get("kind")
        if kind == "trained":
            for group in event.get("groups", []):
                groups.setdefault(group, GroupFate()).steps.append(event["step"])
        elif kind == "dropped_group":
            groups.setdefault(event["group"], GroupFate()).dropped.append(event["reason"])
        elif kind == "resume":  # known to be fed, whatever comes of them
            for group in (*event.get("ready", []), *event.get("rerun", [])):
                groups.setdefault(group, GroupFate())
    return GroupFates(groups, counts)
