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
from tiderl.core.job import JobShape
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.system import System, SystemSpec
from tiderl.sim.config import SimConfig


@dataclass(frozen=True)
class SimScenario:
    """One simulated setup: the profile's ``sim`` section (:class:`SimConfig`: cluster, model,
    workload, the baselines' knobs), the job's shape and the core policies' configs.
    (``sim.experiment`` and ``sim.policies`` say what to run on a scenario; the simulation
    itself ignores them.) The defaults are a 32-GPU cluster's: 100 steps of 32 groups."""

    sim: SimConfig = field(default_factory=SimConfig)
    job: JobShape = field(default_factory=lambda: JobShape(steps=100, batch_groups=32,
                                                           batch_min_groups=16))
    ctb: CTBConfig = field(default_factory=CTBConfig)
    ra2p: RA2PConfig = field(default_factory=RA2PConfig)
    ers: ERSConfig = field(default_factory=ERSConfig)
    kv_block_size: int = 16

    def __post_init__(self) -> None:
        require_int(self.kv_block_size, "kv_block_size", minimum=1)

    def with_sim(self, **changes: object) -> SimScenario:
        """This scenario with ``changes`` to its ``sim`` section."""
        return replace(self, sim=replace(self.sim, **changes))

    def with_job(self, **changes: object) -> SimScenario:
        return replace(self, job=replace(self.job, **changes))

    @property
    def env_step(self) -> tuple[float, float]:
        """The environment step latency override (median, sigma); zeros keep the workload's."""
        return (self.sim.env_step_median_s, self.sim.env_step_sigma)

    def num_rollout_gpus(self) -> int:
        """The initial rollout share, at least one GPU and leaving the trainer at least one."""
        gpus = self.sim.gpus
        if gpus == 1:
            return 1
        return min(gpus - 1, max(1, round(gpus * self.sim.rollout_ratio)))


SYSTEMS: dict[str, SystemSpec] = {s.value: SystemSpec(s) for s in System}
