"""What to simulate: a scenario (cluster, model, workload, RL batch) and the systems compared on it.

A scenario is shared by every system compared on it: same GPUs, same seed (hence the same task
stream), same batch and staleness bound. The systems are the core's (:mod:`tiderl.core.system`),
the same four the runtime runs, each standing for one of the paper's frameworks (§6):

    sync      verl: all GPUs roll out the step's batch, then all train it (one swap pair)
    async     AReaL: fixed rollout/trainer split, request-level rollout, the trainer waits for a
              full batch and runs Ref then Actor (one swap pair per step)
    stream    StreamRL: fixed split, request-level rollout, the trainer streams micro-batches with
              a Ref/Actor swap per micro-batch. "StreamRL always utilizes the maximum-allowed
              GPUs" (§6) is read as: it uses the whole GPU budget, split at the same ratio as the
              others (its dynamic rollout scaling is not modelled; the paper finds it too slow)
    tiderl    CTB + RA2P + ERS; ``SystemSpec(System.TIDERL, ctb=False, ...)`` switches one off:
              no CTB: request-level rollout; no RA2P: stream's trainer; no ERS: fixed split
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tiderl.core.config import require_int
from tiderl.core.ctb import CTBConfig
from tiderl.core.ers import ERSConfig
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.system import System, SystemSpec
from tiderl.sim.config import SimConfig


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

    @property
    def eval_size(self) -> int:
        """Tasks per evaluation group."""
        return self.eval_group_size or self.group_size

    @property
    def env_step(self) -> tuple[float, float]:
        """The environment step latency override (median, sigma); zeros keep the workload's."""
        return (self.env_step_median_s, self.env_step_sigma)

    def ers_config(self) -> ERSConfig:
        """``ers`` with its batch sizes taken from this scenario (samples)."""
        return replace(self.ers, batch_min=self.batch_min, batch_ideal=self.batch_ideal)

    def num_rollout_gpus(self) -> int:
        """The initial rollout share, at least one GPU and leaving the trainer at least one."""
        if self.gpus == 1:
            return 1
        return min(self.gpus - 1, max(1, round(self.gpus * self.rollout_ratio)))


SYSTEMS: dict[str, SystemSpec] = {s.value: SystemSpec(s) for s in System}
