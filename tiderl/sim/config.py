"""Sim section of a profile: the simulated cluster, model and workload, and the baselines' own
knobs. The job's shape (steps, groups, batch, staleness, evaluation) is the profile's ``job``
section (:class:`tiderl.core.job.JobShape`), the same one the runtime reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.config import require, require_choice, require_non_negative, require_positive
from tiderl.core.quote import short
from tiderl.core.system import SYSTEM_CHOICES, System

POLICIES = tuple(s.value for s in System)  # the systems compared; SYSTEM_CHOICES adds aliases
EXPERIMENTS = ("", "fig4", "fig8", "table2", "fig12", "fig14", "fig15")


@dataclass(frozen=True)
class SimConfig:
    experiment: str = ""  # "" = compare `policies` on this scenario; else a paper experiment
    workload: str = "webshop"
    model: str = "qwen2.5-7b"
    gpu: str = "h100-sxm"
    gpus: int = 32
    seed: int = 0  # the workload's
    rollout_ratio: float = 0.25  # initial (and, for fixed-split policies, permanent) share
    request_concurrency: int = 256  # an engine's running requests per GPU (request-level
    # admission fills them: the simulated ctb.request_concurrency)
    ctb_round_interval_s: float = 0.5  # simulated seconds between CTB rounds
    # sync's framework switch between its engine and its trainer, paid each way every step
    # (offload/onload, memory-saver pause/resume, group rebuild); docs/simulator.md
    colocate_switch_s: float = 5.0
    stream_tokens_per_rank: int = 2048  # stream's own micro-batch target (>16 per rank per step)
    async_over_provision: float = 1.0  # async: extra APRIL oversampling on its staleness window
    env_step_median_s: float = 0.0  # > 0: every environment's step latency median (the sweep)
    env_step_sigma: float = 0.0  # > 0: every environment's step latency lognormal sigma
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    # the fixed rollout/train splits a comparison also runs async at (a user's split): TideRL's
    # goodput over the best and the median of them, and its rank among them
    fixed_splits: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        require_choice(self.experiment, EXPERIMENTS, "experiment")
        for name in ("gpus", "request_concurrency", "ctb_round_interval_s"):
            require_positive(getattr(self, name), name)
        for name in ("colocate_switch_s", "env_step_median_s", "env_step_sigma"):
            require_non_negative(getattr(self, name), name)
        require_positive(self.stream_tokens_per_rank, "stream_tokens_per_rank")
        require(self.async_over_provision >= 1.0, "async_over_provision",
                f"expected a number >= 1, got {short(self.async_over_provision)}")
        require(0.0 < self.rollout_ratio < 1.0, "rollout_ratio",
                f"expected a number in (0, 1), got {short(self.rollout_ratio)}")
        for i, ratio in enumerate(self.fixed_splits):
            require(isinstance(ratio, (int, float)) and 0.0 < ratio < 1.0, f"fixed_splits[{i}]",
                    f"expected a number in (0, 1), got {short(ratio)}")
        object.__setattr__(self, "fixed_splits", sorted({float(r) for r in self.fixed_splits}))
        for i, name in enumerate(self.policies):
            require_choice(name, SYSTEM_CHOICES, f"policies[{i}]")
        # the paper's framework names are accepted and mean the system they stand for
        object.__setattr__(self, "policies", [System.parse(n).value for n in self.policies])
