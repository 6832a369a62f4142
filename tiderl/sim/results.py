"""What a simulation reports: per-step records (the core's :class:`StepRecord`, as a real job
writes them to metrics.jsonl), run totals, and the micro-experiments' results."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.records import StepRecord
from tiderl.sim.scenario import SimScenario


@dataclass
class WindowSlots:
    """Where the staleness window's places went: each trained task holds one from its group's
    first admission (which reserves the whole group's) until the window moves past it, once every
    rollout rank has the weights its step made (docs/simulator.md, "Where the window's places
    go"). Seconds summed over trained tasks; ``means()`` per task."""

    tasks: int = 0
    spread_s: float = 0.0  # its group's first admission -> its own
    env_s: float = 0.0  # its environment: the reset and every step
    engine_s: float = 0.0  # its turns on a rank: queued, prefilled, decoded, stalled
    held_s: float = 0.0  # ready for its next turn (or to restart one) while CTB held it paused
    sibling_s: float = 0.0  # done, waiting for the rest of its group
    train_s: float = 0.0  # its group ready -> the end of the step that trained it
    boundary_s: float = 0.0  # that step's end -> the window moved past it (sync, evaluation)

    def add(self, other: WindowSlots) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def means(self) -> dict[str, float]:
        """Seconds per trained task of each part and of the whole place (``slot_s``)."""
        n = self.tasks or 1
        parts = {name: getattr(self, name) / n for name in self.__dataclass_fields__
                 if name != "tasks"}
        return {**parts, "slot_s": sum(parts.values())}


@dataclass
class SimResult:
    """A whole run. Token counters are trajectory tokens (what the trainer processes), except
    ``decoded_tokens`` (model output tokens); at the end of a run
    ``generated_tokens == trained_tokens + discarded_tokens + in_flight_tokens`` exactly."""

    system: str
    scenario: SimScenario
    wall_s: float
    trained_tokens: int
    generated_tokens: int
    discarded_tokens: int
    in_flight_tokens: int
    decoded_tokens: int
    goodput_tok_s: float  # trained tokens / wall_s
    gen_tok_s: float  # decoded tokens / wall_s, whole cluster
    kv_hit_rate: float
    rwt_s: float
    twt_s: float
    num_events: int = 0
    # every GPU-second of the run by what it did (cluster.DEVICE_KEYS; sums to gpus x wall_s)
    device_s: dict[str, float] = field(default_factory=dict)
    num_ctb_rounds: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    policies: dict[str, object] = field(default_factory=dict)
    window: WindowSlots = field(default_factory=WindowSlots)
    window_places: int = 0  # the places of the staleness window, in tasks (0: none)


@dataclass(frozen=True)
class RolloutResult:
    """One GPU rolling out a set of tasks to completion (paper Fig. 12/13)."""

    wall_s: float
    gen_tok_s: float  # decoded tokens per second on the GPU
    kv_hit_rate: float
    num_preemptions: int
    recomputed_tokens: int  # prefill of context that had been computed before
