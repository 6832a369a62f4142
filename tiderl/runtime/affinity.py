"""``runtime.cpu_affinity``: pin each rank process to its own set of cores.

- ``none``: the OS scheduler places the ranks (they may migrate between cores);
- ``spread``: the launcher gives rank i of the N ranks on a node the slot ``i/N``; the rank, when
  it starts, pins itself (``os.sched_setaffinity``) to slot i's share of the cores it may use
  (its inherited affinity). With at least as many cores as ranks each slot is a contiguous block
  (sizes differ by at most one); with fewer, slot i gets core ``i mod cores``, so ranks share a
  core only when they must, and each rank's threads stay on the cores of its own slot.

Pinning adds no capacity: ranks that share cores still share them, but a trainer's threads no
longer migrate onto a rollout rank's core or the other way round.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from tiderl.core.quote import short

NONE, SPREAD = "none", "spread"


def core_set(cores: Sequence[int], slot: int, num_slots: int) -> tuple[int, ...]:
    """The cores of slot ``slot`` (0-based) of ``num_slots`` over ``cores``."""
    if not 0 <= slot < num_slots:
        raise ValueError(f"cpu slot {slot} is outside 0..{num_slots - 1}")
    ordered = sorted(cores)
    if not ordered:
        raise ValueError("no cores to pin to")
    n = len(ordered)
    if n < num_slots:
        return (ordered[slot % n],)
    return tuple(ordered[slot * n // num_slots:(slot + 1) * n // num_slots])


def parse_slot(text: str) -> tuple[int, int]:
    """``"I/N"`` (the rank's ``--cpu-slot``) -> (I, N)."""
    try:
        slot, num = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--cpu-slot expects I/N, got {short(text)}") from None
    core_set(range(num), slot, num)  # checks the range
    return slot, num


def pin_to_slot(slot: int, num_slots: int) -> tuple[int, ...]:
    """Pin this process (every thread it has; threads it starts later inherit it) to its slot's
    share of the cores it may use now; returns them."""
    cores = core_set(os.sched_getaffinity(0), slot, num_slots)
    for task in Path("/proc/self/task").iterdir():  # sched_setaffinity pins one thread
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cores)
    return cores
