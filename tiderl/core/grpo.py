"""GRPO group-standardised advantages (paper §2.1), in plain Python.

A_i = (r_i - mean(r)) / (std(r) + eps) over the G rewards of one group. A group whose rewards are
all equal carries no learning signal and gets zeros (not 0/eps noise). The loss itself needs torch
and lives in ``tiderl.trainer``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(
    rewards: Sequence[float], eps: float = 1e-6, *, scale_by_std: bool = True
) -> list[float]:
    """Advantages of one GRPO group.

    ``std`` is the population standard deviation (ddof=0), so a group of two with rewards 0 and 1
    gets advantages -1 and +1 (up to eps). ``scale_by_std=False`` gives the mean-centred variant
    (Dr. GRPO), which keeps reward scale.
    """
    if not rewards:
        raise ValueError("a GRPO group needs at least one reward")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    n = len(rewards)
    mean = math.fsum(rewards) / n
    centred = [r - mean for r in rewards]
    if all(r == rewards[0] for r in rewards):
        return [0.0] * n
    if not scale_by_std:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / n)
    if std == 0.0:  # spread below float resolution: no signal
        return [0.0] * n
    return [c / (std + eps) for c in centred]


def batch_advantages(
    groups: Sequence[Sequence[float]], eps: float = 1e-6, *, scale_by_std: bool = True
) -> list[list[float]]:
    """``group_advantages`` for each group of a batch, in order."""
    return [group_advantages(g, eps, scale_by_std=scale_by_std) for g in groups]
