"""Sim section of a profile: the simulated cluster and workload."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.config import require, require_choice, require_positive

POLICIES = ("verl", "areal", "streamrl", "tiderl")


@dataclass(frozen=True)
class SimConfig:
    workload: str = "webshop"
    model: str = "qwen2.5-7b"
    gpus: int = 32
    steps: int = 100
    seed: int = 0
    rollout_ratio: float = 0.25  # initial (and, for fixed-split policies, permanent) share
    policies: list[str] = field(default_factory=lambda: list(POLICIES))

    def __post_init__(self) -> None:
        require_positive(self.gpus, "gpus")
        require_positive(self.steps, "steps")
        require(0.0 < self.rollout_ratio < 1.0, "rollout_ratio",
                f"expected a number in (0, 1), got {self.rollout_ratio!r}")
        for i, name in enumerate(self.policies):
            require_choice(name, POLICIES, f"policies[{i}]")
