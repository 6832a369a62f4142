"""The runtime's sections of a profile: ``runtime`` (where and how the job's processes run:
ranks, devices, the bus, liveness, checkpoints), ``logging`` (where the coordinator writes each
step's record, :mod:`tiderl.runtime.log_backends`) and ``report`` (what the run report at the
job's end holds, :mod:`tiderl.runtime.report`).

They live here rather than beside the runtime because the profile, which every layer below the
runtime reads, is built from them; the runtime imports them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.config import require, require_choice, require_non_negative, require_positive
from tiderl.core.system import SYSTEM_CHOICES, System

DEVICES = ("cpu", "cuda")
CPU_AFFINITIES = ("none", "spread")  # see tiderl/launch/affinity.py
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")
WANDB_MODES = ("offline", "online")


@dataclass(frozen=True)
class RuntimeConfig:
    system: str = "tiderl"  # sync | async | stream | tiderl (verl, areal, streamrl accepted)
    num_ranks: int = 4
    rollout_ranks: int = 2  # initial split; ERS moves ranks in system tiderl
    device: str = "cpu"
    threads_per_rank: int = 1
    cpu_affinity: str = "none"  # none | spread: each rank pinned to its own cores
    seed: int = 0  # the task stream's (each group's environment seed)
    bus_host: str = "127.0.0.1"
    run_dir: str = "runs"
    heartbeat_s: float = 1.0
    heartbeat_misses: int = 5
    collective_timeout_s: float = 120.0  # a trainer collective or weight fetch stalls at most
    checkpoint_every: int = 5  # steps between job checkpoints (0: only at the end)
    checkpoint_keep: int = 2  # the newest complete checkpoints kept
    watchdog_s: float = 300.0  # no progress this long (at least): a watchdog event
    watchdog_factor: float = 5.0  # ... or this many mean step times, if longer
    # a recorded job's batches/ folder (logging.batches): train its steps, roll out nothing
    replay: str = ""
    train: bool = True  # false: roll out and form each step's batch, run no optimizer step

    def __post_init__(self) -> None:
        require_choice(self.system, SYSTEM_CHOICES, "system")
        object.__setattr__(self, "system", System.parse(self.system).value)
        require_choice(self.device, DEVICES, "device")
        require_choice(self.cpu_affinity, CPU_AFFINITIES, "cpu_affinity")
        for name in ("num_ranks", "threads_per_rank", "heartbeat_s", "heartbeat_misses",
                     "collective_timeout_s", "checkpoint_keep", "watchdog_s", "watchdog_factor"):
            require_positive(getattr(self, name), name)
        require_non_negative(self.checkpoint_every, "checkpoint_every")
        require(self.train or not self.replay, "train",
                "expected true with runtime.replay (a replay trains its recording), got false")
        if self.system == "sync":  # one colocated set: every rank rolls out, then trains
            require(self.rollout_ranks == self.num_ranks, "rollout_ranks",
                    f"expected num_ranks ({self.num_ranks}) in system sync, got "
                    f"{self.rollout_ranks}")
        else:
            require(self.num_ranks >= 2, "num_ranks",
                    f"expected at least 2 in system {self.system} (a rollout rank and a trainer "
                    f"rank; system sync runs on one), got {self.num_ranks}")
            require(1 <= self.rollout_ranks < self.num_ranks, "rollout_ranks",
                    f"expected 1..{self.num_ranks - 1} (at least one trainer rank), "
                    f"got {self.rollout_ranks}")


@dataclass(frozen=True)
class LoggingConfig:
    """Where each step's record goes: metrics.jsonl always (the report, ``tiderl status`` and
    ``--resume`` read it), TensorBoard event files and a wandb run beside it when listed."""

    backends: list[str] = field(default_factory=lambda: ["jsonl"])
    wandb_project: str = "tiderl"
    wandb_mode: str = "offline"  # online sends the run to the wandb server as it goes
    # every finished episode to rollouts/rank-N.jsonl: its ids per turn as trained, and the
    # turns as the environment and the engine saw them (docs/models.md)
    rollouts: bool = False
    # every step's micro-batches as trained, with its start and loss, to batches/step-N.msgpack
    # (docs/runtime.md): what runtime.replay trains again
    batches: bool = False

    def __post_init__(self) -> None:
        for i, name in enumerate(self.backends):
            require_choice(name, LOG_BACKENDS, f"backends[{i}]")
        require(len(set(self.backends)) == len(self.backends), "backends",
                f"expected each backend once, got {self.backends}")
        require("jsonl" in self.backends, "backends",
                f"expected jsonl in the list (report.md, tiderl status and --resume read "
                f"metrics.jsonl), got {self.backends}")
        require(bool(self.wandb_project), "wandb_project", "expected a project name, got ''")
        require_choice(self.wandb_mode, WANDB_MODES, "wandb_mode")


@dataclass(frozen=True)
class ReportConfig:
    """The run report the coordinator writes when the job ends: report.md always; its figures
    (three PNGs, a few seconds of matplotlib) unless ``plots`` is false."""

    plots: bool = True
