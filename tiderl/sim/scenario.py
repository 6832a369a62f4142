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

from tiderl.core.config import require_choice, require_int
from tiderl.core.ctb import CTBConfig
from tiderl.core.ers import ERSConfig
from tiderl.core.ra2p import RA2PConfig
from tiderl.sim.config import SimConfig

SYSTEM_NAMES = ("verl", "areal", "streamrl", "tiderl")


@dataclass(frozen=True)
class SimScenario(SimConfig):
    """One simulated setup: the profile's ``sim`` section (:class:`SimConfig`) plus the core
    policies' configs. Batches are in GRPO groups of ``group_size`` samples (tasks):
    B_ideal = batch_groups·group_size, B_min = batch_min_groups·group_size. (``experiment`` and
    ``policies`` say what to run on a scenario; the simulation itself ignores them.)"""

    kv_block_size: int = 16
    ctb: CTBConfig = field(default_factory=CTBConfig)
    ra2p: RA2PConfig = field(default_factory=RA2PConfig)
    ers: ERSConfig = field(default_factory=lambda: ERSConfig(batch_min=128, batch_ideal=256))

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int(self.kv_block_size, "kv_block_size", minimum=1)

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
        if self.gpus == 1:
            return 1
        return min(self.gpus - 1, max(1, round(self.gpus * self.rollout_ratio)))


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
