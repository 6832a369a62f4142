"""What a simulation reports: per-step records (the core's :class:`StepRecord`, as a real job
writes them to metrics.jsonl), run totals, and the micro-experiments' results."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.records import StepRecord
from tiderl.sim.scenario import SimScenario


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


@dataclass(frozen=True)
class RolloutResult:
    """One GPU rolling out a set of tasks to completion (paper Fig. 12/13)."""

    wall_s: float
    gen_tok_s: float  # decoded tokens per second on the GPU
    kv_hit_rate: float
    num_preemptions: int
    recomputed_tokens: int  # prefill of context that had been computed before
