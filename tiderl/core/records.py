"""One optimizer step as every reader sees it: ``metrics.jsonl``, ``report.md``, ``/metrics``,
``tiderl top`` and the simulator's results are all :class:`StepRecord` s built by the step
controller (:mod:`tiderl.core.step_control`).

Times are seconds since the job's launch on its own clock (simulated or monotonic); RWT and TWT
are rank-seconds. ``to_dict`` is the ``metrics.jsonl`` line (DESIGN §7); ``from_dict`` reads one
back, with a ValueError naming the first missing key.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields

from tiderl.core.system import StepMode


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    start_s: float  # when the step opened
    end_s: float  # when its last trainer rank finished (the goodput clock)
    trained_tokens: int  # whole sequences of the samples this step consumed
    trained_tokens_total: int
    trained_samples: int
    generated_tokens_total: int  # model output tokens of every turn so far
    discarded_tokens_total: int  # sequences dropped as too stale to train
    ras: int  # micro-batches ready at the step start
    tprm_s: float | None  # mean gap between later ready micro-batches (None: < 2 of them)
    rwt_s: float  # rollout wait since the previous record
    twt_s: float  # trainer ranks' waits for data, in the step and before it opened
    step_mode: StepMode
    roles: tuple[str, ...]  # every rank's role while the step ran
    num_rollout: int
    num_trainer: int
    num_micro_batches: int
    kv_hit_rate: float | None  # prefix hits / lookups over the step (None: no lookups)
    staleness_max: int  # step minus the oldest version among its tokens
    reward_mean: float | None
    solved_frac: float | None  # share of trained samples with reward >= 1
    eval_reward: float | None  # an evaluation's mean reward, when one finished
    loss: float | None
    grad_norm: float | None
    batch_size: int  # samples the (elastic) batch held
    ers_reason: str | None  # the reason of the plan that laid this step out
    trained_loss_tokens: int | None = None  # of trained_tokens, those the loss counts (response
    # tokens; None: the substrate does not report them, as the simulator)
    rollout_saturated_s: float | None = None  # rollout rank-seconds since the previous record
    # with tasks waiting for admission: every rank full (None: a record written before it)
    generating_share: float | None = None  # of the task-seconds placed tasks spent since the
    # previous record, the share generating (the rest: waiting for their environments)
    ctb_pauses: int | None = None  # CTB pauses since the previous record (None: before it)
    ctb_releases: int | None = None  # of them, tasks released for their environment's wait
    is_trained: bool = True  # False: no optimizer step ran on the batch (runtime.train false)
    recorded_loss: float | None = None  # a replayed step's loss in its recording (runtime.replay)
    kv_retention: float | None = None  # of the context turns left in their rank's KV (whole
    # blocks, at the version served), the share their task's next prompt found cached, since the
    # previous record (None: no such turn, or a substrate that does not report it)

    @property
    def time_s(self) -> float:
        return self.end_s

    @property
    def step_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def version(self) -> int:
        """The policy version this step's update made."""
        return self.step + 1

    @property
    def goodput_tok_s(self) -> float:
        """Trained tokens per second since launch, at the end of this step."""
        return self.trained_tokens_total / self.end_s if self.end_s > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        """The ``metrics.jsonl`` line: every field, rounded, plus time_s, step_s, version and
        goodput_tok_s."""
        row = {name: _rounded(value) for name, value in asdict(self).items()}
        row.update(step_mode=self.step_mode.value, roles=list(self.roles),
                   time_s=round(self.time_s, 3), step_s=round(self.step_s, 3),
                   version=self.version, goodput_tok_s=round(self.goodput_tok_s, 2))
        return row

    @classmethod
    def from_dict(cls, row: dict[str, object]) -> StepRecord:
        """A ``metrics.jsonl`` line read back (``mode``: the step mode's key in older runs)."""
        if "mode" in row and "step_mode" not in row:
            row = {**row, "step_mode": row["mode"]}
        missing = [f.name for f in fields(cls) if f.name not in row and f.default is MISSING]
        if missing:
            raise ValueError(f"a step record needs {missing[0]!r}")
        values = {f.name: row[f.name] for f in fields(cls) if f.name in row}
        values.update(step_mode=StepMode(values["step_mode"]), roles=tuple(values["roles"]))
        return cls(**values)


def reward_summary(rewards: list[float]) -> tuple[float | None, float | None]:
    """(mean reward, share of rewards >= 1: solved episodes) of a step's trained samples."""
    if not rewards:
        return None, None
    return sum(rewards) / len(rewards), sum(r >= 1.0 for r in rewards) / len(rewards)


def _rounded(value: object) -> object:
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    return value
