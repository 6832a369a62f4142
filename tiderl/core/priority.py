"""P(t), the priority of Table 1 by which CTB pauses and resumes tasks: its weights and its
formula (``TaskBook.priority`` caches it per task)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

from tiderl.core.config import require_non_negative


class Scored(Protocol):
    """What P(t) reads of a task (``TaskRecord``)."""

    is_eval: bool
    is_running: bool
    context_len: int


class Completion(Protocol):
    """What P(t) reads of its group (``GroupRecord``)."""

    num_finished: int

    @property
    def size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PriorityWeights:
    """Weights of P(t) = eval·I_eval + group_completion·G_completion + active·I_active
    + context·L_context, with L_context = min(context_len / context_norm_tokens, 1) in [0, 1].

    Table 1's tiers are strict when no sum of lower tiers can outweigh the smallest step of a
    higher one: context·1 < active; active + context < group_completion / G (G_completion moves in
    steps of 1/G for groups of size G); group_completion + active + context < eval. The defaults
    (1, 2, 256, 512) hold for G <= 64: 256/64 = 4 > 3 and 512 > 259. The group bound assumes the
    groups share one size, as GRPO's do; groups of sizes a != b differ by as little as 1/lcm(a, b).
    """

    eval: float = 512.0
    group_completion: float = 256.0
    active: float = 2.0
    context: float = 1.0

    def __post_init__(self) -> None:
        for spec in fields(self):
            require_non_negative(getattr(self, spec.name), spec.name)

    def tiers_are_strict(self, max_group_size: int) -> bool:
        if max_group_size < 1:
            raise ValueError(f"max_group_size must be >= 1, got {max_group_size!r}")
        lower = self.active + self.context
        return (
            self.context < self.active
            and lower < self.group_completion / max_group_size
            and self.group_completion + lower < self.eval
        )


def priority(
    task: Scored, group: Completion, weights: PriorityWeights, context_norm_tokens: int
) -> float:
    """P(t) of Table 1: eval tasks, then group completion, then running, then context length."""
    score = weights.group_completion * (group.num_finished / group.size)
    score += weights.context * min(task.context_len / context_norm_tokens, 1.0)
    if task.is_eval:
        score += weights.eval
    if task.is_running:
        score += weights.active
    return score
