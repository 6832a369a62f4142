"""What the step controller tells its adapter to do, and what the adapter reports back: plain data.

Commands (out of :class:`tiderl.core.step_control.StepController`), in the order an adapter must
apply them; each adapter turns them into its substrate's actions (bus messages, or events on the
simulator's heap)::

    FeedGroups     groups the adapter now runs (their tasks are in CTB's book already)
    JoinRollout    a rank's engine is up: CTB places tasks on it from now on
    LeaveRollout   a rank left rollout (a plan moved it, or it died): its tasks resume elsewhere
    StartStep      open optimizer step ``step`` on these ranks in this mode
    Dispatch       a micro-batch of the open step, to its ranks
    CloseStep      the open step's batch is complete
    AbortStep      a trainer rank of the open step died: its ranks drop this attempt
    RecordStep     the step's record (metrics.jsonl, report, /metrics, top, sim results)
    Boundary       the post-update boundary: roles, the weights of ``version``
    Retire         the staleness window moved (every rollout rank has the new version)
    GroupDropped   a group left the buffer untrained (too stale, or a task produced no turn)
    PlanRefused    a plan the layout limits forbid; the roles stay as they are
    ManualReply    an answer to an operator's plan (``tiderl rebalance``)
    Finish         the last step is done
    Abort          the job cannot go on

CTB's decisions (:class:`tiderl.core.types.Admit`, ``Pause``, ``Resume``) come out of
``schedule``. Reports in: :class:`RankReport` per trainer rank in a :class:`StepOutcome`, and a
:class:`ManualRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tiderl.core.records import StepRecord
from tiderl.core.system import StepMode
from tiderl.core.types import MicroBatch, Placement, PlanReason, Role

# --------------------------------------------------------------------------- reports in


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A group the controller feeds: ``index`` counts training (or this phase's evaluation)
    groups from 0; ``step`` is the step it was fed for."""

    group_id: str
    index: int
    is_eval: bool
    step: int


@dataclass(frozen=True, slots=True)
class RankReport:
    """One trainer rank's account of a step: its wait for data and its measured per-micro-batch
    pass times (None: this rank did not run that pass), its loss when it is an actor."""

    rank: int
    wait_s: float = 0.0
    t_ref: float | None = None
    t_act_f: float | None = None
    t_act_b: float | None = None
    t_swap: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    loss_tokens: int | None = None  # the step's loss-mask (response) tokens, all ranks together
    failed: bool = False  # its part failed (a collective with a rank that died): no update


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """A finished step: every trainer rank's report, and what only the substrate knows
    (cumulative prefix-cache counters over all rollout ranks, the trained samples' rewards).
    ``is_trained`` false: the substrate ran no optimizer step on the batch (a roll-out-only
    job); ``recorded_loss``: the loss its recording has (a replayed step)."""

    step: int
    reports: tuple[RankReport, ...]
    kv_queries: int = 0
    kv_hits: int = 0
    reward_mean: float | None = None
    solved_frac: float | None = None
    eval_reward: float | None = None
    is_trained: bool = True
    recorded_loss: float | None = None

    def actor_figures(self, actor_ranks: tuple[int, ...]
                      ) -> tuple[float | None, float | None, int | None]:
        """The step's loss (the mean over its actor ranks), grad norm (the lowest actor
        rank's) and trained loss tokens (every actor reports the step's total); None where
        no actor reported one."""
        actors = sorted((r for r in self.reports if r.rank in actor_ranks), key=lambda r: r.rank)
        losses = [r.loss for r in actors if r.loss is not None]
        return (sum(losses) / len(losses) if losses else None,
                actors[0].grad_norm if actors else None,
                max((r.loss_tokens for r in actors if r.loss_tokens is not None), default=None))


@dataclass(frozen=True, slots=True)
class ManualRequest:
    """An operator's layout: ``rollout`` + ``trainer`` ranks, RA2P's placement (None: keep).
    ``key`` identifies the requester for the replies."""

    key: object
    rollout: int
    trainer: int
    placement: Placement | None = None

    def describe(self, placement: Placement | None = None) -> str:
        """"R2/T1 colocated": the counts and placement, for events and notes."""
        shown = placement or self.placement
        return f"R{self.rollout}/T{self.trainer}" + (f" {shown.value}" if shown else "")


# --------------------------------------------------------------------------- commands out


@dataclass(frozen=True, slots=True)
class FeedGroups:
    groups: tuple[GroupSpec, ...]
    is_eval: bool


@dataclass(frozen=True, slots=True)
class JoinRollout:
    rank: int
    budget: int  # CTB's token budget B_r on it


@dataclass(frozen=True, slots=True)
class LeaveRollout:
    """``task_ids`` were active there; CTB resumes them on other ranks (from their carry after a
    move; from scratch when the rank died). Tasks paused there keep it as their last rank."""

    rank: int
    task_ids: tuple[str, ...]
    is_dead: bool = False


@dataclass(frozen=True, slots=True)
class StartStep:
    step: int
    step_mode: StepMode
    ref_ranks: tuple[int, ...]
    actor_ranks: tuple[int, ...]
    max_aggregate: int  # colocated: micro-batches per swap pair; 0: the whole batch; else 1
    attempt: int = 0  # > 0: the step runs again, on the ranks left after a trainer rank died

    @property
    def ranks(self) -> tuple[int, ...]:
        return (*self.ref_ranks, *self.actor_ranks)


@dataclass(frozen=True, slots=True)
class Dispatch:
    step: int
    index: int  # the step's micro-batches in the order they are sent, from 0
    mb: MicroBatch


@dataclass(frozen=True, slots=True)
class CloseStep:
    step: int


@dataclass(frozen=True, slots=True)
class AbortStep:
    """Attempt ``attempt`` of the open step lost a trainer rank: its live ranks stop it (a rank
    blocked in a collective with the dead one fails by itself) and report how it ended."""

    step: int
    attempt: int


@dataclass(frozen=True, slots=True)
class RecordStep:
    record: StepRecord


@dataclass(frozen=True, slots=True)
class Boundary:
    """Every live rank (``members``) takes ``roles``; the ranks that need the weights of
    ``version`` get them from ``src_rank`` (an actor that stays one); ``joiners`` (new actors)
    also get the optimizer state.
    Version 0 is the launch plan: roles only, no weights move. ``checkpoint``: the actors save
    one first; ``export``: the source writes the weights as an HF folder."""

    version: int
    roles: tuple[Role, ...]
    old_roles: tuple[Role, ...]
    members: tuple[int, ...]
    src_rank: int
    joiners: tuple[int, ...]
    reason: PlanReason | None
    checkpoint: bool = False
    export: bool = False
    is_final: bool = False  # after the last step: weights, checkpoint and export only


@dataclass(frozen=True, slots=True)
class Retire:
    num_tasks: int
    admission_limit: int | None  # training tasks that may now have been admitted in all


class DropReason(str, Enum):
    STALE = "stale"  # older than the staleness bound allows for its batch
    NO_TURN = "a task produced no turn"  # nothing to train on


@dataclass(frozen=True, slots=True)
class GroupDropped:
    group_id: str
    reason: DropReason
    oldest_version: int | None  # of a stale group
    batch: int


@dataclass(frozen=True, slots=True)
class PlanRefused:
    reason: str
    plan_reason: PlanReason


@dataclass(frozen=True, slots=True)
class ManualReply:
    """``status``: "accepted" (applies at the boundary after ``step``), "refused" (``reason``),
    "applied" (at ``version``, with ``roles`` and ``placement``), "released" (``--auto``; ``reason``
    says what happens next, ``was_held`` whether a layout was held)."""

    request: ManualRequest | None  # None for a release
    key: object
    status: str
    step: int
    reason: str = ""
    version: int = 0
    roles: tuple[Role, ...] = ()
    placement: Placement | None = None
    was_held: bool = False
    is_at_boundary: bool = False  # decided at the post-update boundary, not on request


@dataclass(frozen=True, slots=True)
class Finish:
    num_steps: int


@dataclass(frozen=True, slots=True)
class Abort:
    reason: str


Command = (FeedGroups | JoinRollout | LeaveRollout | StartStep | Dispatch | CloseStep
           | AbortStep | RecordStep | Boundary | Retire | GroupDropped | PlanRefused
           | ManualReply | Finish | Abort)
