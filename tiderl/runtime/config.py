"""Runtime section of a profile: the job's shape (ranks, steps, groups, staleness)."""

from __future__ import annotations

from dataclasses import dataclass

from tiderl.core.config import require, require_choice, require_non_negative, require_positive

MODES = ("sync", "async", "stream", "tiderl")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class RuntimeConfig:
    mode: str = "tiderl"  # sync | async | stream | tiderl (see docs)
    num_ranks: int = 4
    rollout_ranks: int = 2  # initial split; ERS moves ranks in mode tiderl
    device: str = "cpu"
    threads_per_rank: int = 1
    steps: int = 20
    group_size: int = 8  # GRPO G
    max_staleness: int = 1  # versions
    eval_every: int = 0  # steps; 0 = no evaluation
    eval_groups: int = 4
    seed: int = 0
    bus_host: str = "127.0.0.1"
    run_dir: str = "runs"
    heartbeat_s: float = 1.0
    heartbeat_misses: int = 5
    collective_timeout_s: float = 120.0  # a broadcast a rank died in fails after this

    def __post_init__(self) -> None:
        require_choice(self.mode, MODES, "mode")
        require_choice(self.device, DEVICES, "device")
        for name in ("num_ranks", "threads_per_rank", "steps", "group_size", "heartbeat_s",
                     "heartbeat_misses", "eval_groups", "collective_timeout_s"):
            require_positive(getattr(self, name), name)
        require_non_negative(self.max_staleness, "max_staleness")
        require_non_negative(self.eval_every, "eval_every")
        if self.mode == "sync":  # one colocated set: every rank rolls out, then trains
            require(self.rollout_ranks == self.num_ranks, "rollout_ranks",
                    f"expected num_ranks ({self.num_ranks}) in mode sync, got {self.rollout_ranks}")
        else:
            require(1 <= self.rollout_ranks < self.num_ranks, "rollout_ranks",
                    f"expected 1..{self.num_ranks - 1} (at least one trainer rank), "
                    f"got {self.rollout_ranks}")
