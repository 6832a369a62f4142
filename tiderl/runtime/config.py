"""Runtime section of a profile: the job's shape (ranks, steps, groups, staleness), and the
step cycle a whole profile asks the coordinator for; the logging section: where the coordinator
writes each step's record (:mod:`tiderl.runtime.log_backends`); the report section: what the run
report at the job's end holds (:mod:`tiderl.runtime.report`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tiderl.core.config import require, require_choice, require_non_negative, require_positive
from tiderl.core.step_control import LayoutLimits, StepControlConfig
from tiderl.core.system import SYSTEM_CHOICES, System, SystemSpec

if TYPE_CHECKING:
    from tiderl.profile import Profile

DEVICES = ("cpu", "cuda")
CPU_AFFINITIES = ("none", "spread")  # see tiderl/launch/affinity.py
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")
WANDB_MODES = ("offline", "online")


@dataclass(frozen=True)
class RuntimeConfig:
    mode: str = "tiderl"  # the system: sync | async | stream | tiderl (verl, areal, streamrl)
    num_ranks: int = 4
    rollout_ranks: int = 2  # initial split; ERS moves ranks in mode tiderl
    device: str = "cpu"
    threads_per_rank: int = 1
    cpu_affinity: str = "none"  # none | spread: each rank pinned to its own cores
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
    checkpoint_every: int = 5  # steps between job checkpoints (0: only at the end)
    checkpoint_keep: int = 2  # the newest complete checkpoints kept
    watchdog_s: float = 300.0  # no progress this long (at least): a watchdog event
    watchdog_factor: float = 5.0  # ... or this many mean step times, if longer

    def __post_init__(self) -> None:
        require_choice(self.mode, SYSTEM_CHOICES, "mode")
        object.__setattr__(self, "mode", System.parse(self.mode).value)
        require_choice(self.device, DEVICES, "device")
        require_choice(self.cpu_affinity, CPU_AFFINITIES, "cpu_affinity")
        for name in ("num_ranks", "threads_per_rank", "steps", "group_size", "heartbeat_s",
                     "heartbeat_misses", "eval_groups", "collective_timeout_s",
                     "checkpoint_keep", "watchdog_s", "watchdog_factor"):
            require_positive(getattr(self, name), name)
        require_non_negative(self.max_staleness, "max_staleness")
        require_non_negative(self.eval_every, "eval_every")
        require_non_negative(self.checkpoint_every, "checkpoint_every")
        if self.mode == "sync":  # one colocated set: every rank rolls out, then trains
            require(self.rollout_ranks == self.num_ranks, "rollout_ranks",
                    f"expected num_ranks ({self.num_ranks}) in mode sync, got {self.rollout_ranks}")
        else:
            require(self.num_ranks >= 2, "num_ranks",
                    f"expected at least 2 in mode {self.mode} (a rollout rank and a trainer "
                    f"rank; mode sync runs on one), got {self.num_ranks}")
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


def control_config(profile: Profile) -> StepControlConfig:
    """The step cycle a profile asks for (``runtime.mode`` names the system). Without a KL term
    (``trainer.kl_beta`` 0) no step runs a Ref pass, so RA2P's choice is colocated: a Ref rank
    would have nothing to compute."""
    rt, trainer = profile.runtime, profile.trainer
    ra2p = profile.ra2p
    if trainer.kl_beta == 0 and ra2p.mode == "auto":
        ra2p = replace(ra2p, mode="colocated")
    return StepControlConfig(
        system=SystemSpec(System.parse(rt.mode)), num_steps=rt.steps, group_size=rt.group_size,
        max_staleness=rt.max_staleness, ctb=profile.ctb, ra2p=ra2p, ers=profile.ers,
        rank_budget=profile.ctb.rank_budget(profile.engine.kv_cache_tokens),
        max_new_tokens=profile.engine.max_new_tokens, eval_every=rt.eval_every,
        eval_groups=rt.eval_groups, checkpoint_every=rt.checkpoint_every,
        export_every=trainer.export_every, tensor_parallel=trainer.tensor_parallel,
        limits=LayoutLimits(grouped_ranks=rt.num_ranks,
                            fixed_actor_backend="megatron" if trainer.backend == "megatron"
                            else "",
                            sharded_actor_backend="fsdp2" if trainer.backend == "fsdp2"
                            else ""))
