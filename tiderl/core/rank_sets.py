"""The trainer rank sets a job makes process groups for at start-up (none is built at run time).

Every rank calls ``torch.distributed.new_group`` for the same sets in the same order. The sets are
every non-empty subset of the ranks for small jobs; beyond ``MAX_ALL_SUBSETS`` ranks, every
contiguous range (ERS moves the highest rank ids first and trainer ranks start as a contiguous
block, so the actor sets it forms stay ranges). The step controller's layout limits
(``step_control.LayoutLimits``) refuse a plan whose actor set has no group (``has_group``) and keep
the layout it had.
"""

from __future__ import annotations

from itertools import combinations

MAX_ALL_SUBSETS = 6


def trainer_sets(num_ranks: int) -> list[tuple[int, ...]]:
    """The rank sets that get a process group, in creation order."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    ranks = range(num_ranks)
    if num_ranks <= MAX_ALL_SUBSETS:
        return [c for size in range(1, num_ranks + 1) for c in combinations(ranks, size)]
    return [tuple(range(a, b)) for a in ranks for b in range(a + 1, num_ranks + 1)]


def has_group(ranks: set[int] | tuple[int, ...], num_ranks: int) -> bool:
    key = tuple(sorted(ranks))
    if not key:
        return False
    if num_ranks <= MAX_ALL_SUBSETS:
        return key[-1] < num_ranks and key[0] >= 0
    return key == tuple(range(key[0], key[-1] + 1)) and key[-1] < num_ranks
