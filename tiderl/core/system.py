"""What is compared and how a step trains: one vocabulary for the simulator and the runtime.

A :class:`System` is a design point (paper §6): ``tiderl sim`` and ``tiderl bench e2e`` compare the
same four names, so a simulated figure and a measured one speak of the same thing. The paper's
frameworks are descriptions of them (and accepted as aliases: ``verl`` is ``sync``)::

    sync     verl-like: every rank rolls out the batch, then every rank trains it (staleness 0)
    async    AReaL-like: a fixed rollout/trainer split, request-level rollout, whole batches
    stream   StreamRL-like: a fixed split, request-level rollout, micro-batches streamed with a
             Ref/Actor swap each (VSO)
    tiderl   CTB + RA2P + ERS (each switchable for the ablation of paper Table 2)

A :class:`StepMode` is how one optimizer step consumes its micro-batches; the RA2P choice
(:class:`tiderl.core.types.Placement`, decoupled or colocated) is two of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tiderl.core.config import ConfigError
from tiderl.core.quote import short


class System(str, Enum):
    SYNC = "sync"
    ASYNC = "async"
    STREAM = "stream"
    TIDERL = "tiderl"

    @classmethod
    def parse(cls, name: str) -> System:
        """A system by name or by the framework it stands for (``verl``, ``areal``,
        ``streamrl``); ConfigError naming the choices otherwise."""
        name = ALIASES.get(name, name)
        try:
            return cls(name)
        except ValueError:
            choices = ", ".join([*(s.value for s in cls), *ALIASES])
            raise ConfigError("", f"expected one of {choices}, got {short(name)}") from None



ALIASES = {"verl": "sync", "areal": "async", "streamrl": "stream"}
SYSTEM_CHOICES = (*(s.value for s in System), *ALIASES)


class StepMode(str, Enum):
    """How a trainer step runs Ref and Actor over its micro-batches."""

    COLOCATED = "colocated"  # RA2P CM: Ref and Actor on the same ranks, ready batches aggregated
    DECOUPLED = "decoupled"  # RA2P DM: Ref on its own ranks, loss deferred into backward
    VS = "vs"  # vanilla streaming: Ref/Actor alternate per micro-batch, no offload
    VSO = "vso"  # vanilla streaming with a model swap (offload) per micro-batch
    BATCH = "batch"  # the whole batch at once: Ref over all, one swap, Actor over all

    @property
    def has_swaps(self) -> bool:
        """Whether Ref and Actor share a device and swap (every mode but decoupled and vs)."""
        return self not in (StepMode.DECOUPLED, StepMode.VS)


@dataclass(frozen=True)
class SystemSpec:
    """A system to run; ``ctb``, ``ra2p`` and ``ers`` switch TideRL's parts off (the ablation)
    and mean nothing for the baselines."""

    system: System
    ctb: bool = True
    ra2p: bool = True
    ers: bool = True

    @classmethod
    def named(cls, name: str) -> SystemSpec:
        return cls(System.parse(name))

    @property
    def is_sync(self) -> bool:
        return self.system is System.SYNC

    @property
    def uses_ctb(self) -> bool:
        return self.system is System.TIDERL and self.ctb

    @property
    def uses_ers(self) -> bool:
        return self.system is System.TIDERL and self.ers

    @property
    def uses_ra2p(self) -> bool:
        return self.system is System.TIDERL and self.ra2p

    @property
    def streams(self) -> bool:
        """Whether a step opens before its batch is complete (micro-batches stream in)."""
        return self.system in (System.STREAM, System.TIDERL)

    @property
    def fixed_step_mode(self) -> StepMode | None:
        """The step mode every step runs, or None when RA2P chooses it."""
        if self.system in (System.SYNC, System.ASYNC):
            return StepMode.BATCH
        if self.system is System.STREAM or not self.ra2p:
            return StepMode.VSO
        return None

    def max_staleness(self, bound: int) -> int:
        """A synchronous system trains only on the current version."""
        return 0 if self.is_sync else bound

    @property
    def label(self) -> str:
        off = [part for part in ("ctb", "ra2p", "ers") if not getattr(self, part)]
        if self.system is not System.TIDERL or not off:
            return self.system.value
        return "tiderl-" + "-".join(f"no_{part}" for part in off)
