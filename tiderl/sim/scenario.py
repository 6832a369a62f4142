"""What to simulate: a scenario (cluster, model, workload, RL batch) and a system (the policies).

A scenario is shared by every system compared on it: same GPUs, same seed (hence the same task
stream), same batch and staleness bound. A system is one of the paper's frameworks (§6):

    verl      synchronous: all GPUs roll out the step's batch, then all train it (colocated)
    areal     asynchronous, fixed rollout/trainer split, request-level rollout, the trainer waits
              for a full batch and runs Ref then Actor (one swap pair per step)
    streamrl  asynchronous, fixed split, request-level rollout, the trainer streams micro-batches
              with a Ref/Actor swap per micro-batch. "StreamRL always utilizes the maximum-allowed
              GPUs" (§6) is read as: it uses the whole GPU budget, split at the same ratio as the
              others (its dynamic rollout scaling is not modelled; the paper finds it too slow)
    tiderl    CTB + RA2P + ERS; ``SystemSpec("tiderl", ctb=False, ...)`` switches one off:
              no CTB: request-level rollout; no RA2P: streamrl's trainer; no ERS: fixed split
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tiderl.core.config import require, require_choice, require_int
from tiderl.core.ctb import CTBConfig
from tiderl.core.ers import ERSConfig
from tiderl.core.ra2p import RA2PConfig

SYSTEM_NAMES = ("verl", "areal", "streamrl", "tiderl")


@dataclass(frozen=True)
class SimScenario:
    """One simulated setup. Batches are in GRPO groups of ``group_size`` samples (tasks):
    B_ideal = batch_groups·group_size, B_min = batch_min_groups·group_size."""

    workload: str = "webshop"
    model: str = "qwen2.5-7b"
    gpu: str = "h100-sxm"
    num_gpus: int = 8
    steps: int = 100
    seed: int = 0
    group_size: int = 8
    batch_groups: int = 32
    batch_min_groups: int = 16
    max_staleness: int = 1
    eval_every: int = 0  # an evaluation phase every this many steps (0: none)
    eval_groups: int = 0  # groups per evaluation phase
    rollout_ratio: float = 0.25  # initial rollout share (fixed-split systems keep it)
    request_concurrency: int = 256  # running requests per rollout GPU (engine max_num_seqs)
    kv_block_size: int = 16
    ctb_round_interval_s: float = 0.5
    ctb: CTBConfig = field(default_factory=CTBConfig)
    ra2p: RA2PConfig = field(default_factory=RA2PConfig)
    ers: ERSConfig = field(default_factory=lambda: ERSConfig(batch_min=128, batch_ideal=256))

    def __post_init__(self) -> None:
        for key in ("num_gpus", "steps", "group_size", "batch_groups", "batch_min_groups",
                    "request_concurrency", "kv_block_size"):
            require_int(getattr(self, key), key, minimum=1)
        for key in ("max_staleness", "eval_every", "eval_groups", "seed"):
            require_int(getattr(self, key), key, minimum=0)
        require(self.batch_min_groups <= self.batch_groups, "batch_min_groups",
                f"expected <= batch_groups ({self.batch_groups}), got {self.batch_min_groups}")
        require(0.0 < self.rollout_ratio < 1.0 or self.num_gpus == 1, "rollout_ratio",
                f"expected a number in (0, 1), got {self.rollout_ratio!r}")
        require(self.ctb_round_interval_s > 0, "ctb_round_interval_s",
                f"expected a positive number, got {self.ctb_round_interval_s!r}")

    @property
    def batch_ideal(self) -> int:
        """B_ideal in samples."""
        return self.batch_groups * self.group_size

    @property
    def batch_min(self) -> int:
        return self.batch_min_groups * self.group_size

    def ers_config(self) -> ERSConfig:
        """``ers`` with its batch sizes taken from this scenario (samples)."""
        return replace(self.ers, batch_min=self.batch_min, batch_ideal=self.batch_ideal)

    def num_rollout_gpus(self) -> int:
        """The initial rollout share, at least one GPU and leaving the trainer at least one."""
        if self.num_gpus == 1:
            return 1
        return min(self.num_gpus - 1, max(1, round(self.num_gpus * self.rollout_ratio)))


@dataclass(frozen=True)
class SystemSpec:
    """A framework to simulate; ``ctb``, ``ra2p`` and ``ers`` switch TideRL's parts (ablations)
    and are ignored by the baselines."""

    name: str
    ctb: bool = True
    ra2p: bool = True
    ers: bool = True

    def __post_init__(self) -> None:
        require_choice(self.name, SYSTEM_NAMES, "name")

    @property
    def is_sync(self) -> bool:
        return self.name == "verl"

    @property
    def uses_ctb(self) -> bool:
        return self.name == "tiderl" and self.ctb

    @property
    def uses_ers(self) -> bool:
        return self.name == "tiderl" and self.ers

    @property
    def trainer_kind(self) -> str:
        """How the trainer consumes a step: "sync" (verl), "batch" (areal: whole batch, one swap
        pair), "vso" (streamrl: a swap per micro-batch) or "ra2p" (tiderl)."""
        if self.name == "verl":
            return "sync"
        if self.name == "areal":
            return "batch"
        if self.name == "streamrl" or not self.ra2p:
            return "vso"
        return "ra2p"

    @property
    def label(self) -> str:
        off = [part for part in ("ctb", "ra2p", "ers") if not getattr(self, part)]
        if self.name != "tiderl" or not off:
            return self.name
        return "tiderl-" + "-".join(f"no_{part}" for part in off)


SYSTEMS: dict[str, SystemSpec] = {name: SystemSpec(name) for name in SYSTEM_NAMES}
