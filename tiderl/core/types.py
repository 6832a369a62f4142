"""Shared vocabulary: roles, placements, lifecycles, tasks, trajectories, micro-batches,
decisions.

Lifecycles (Enums below):

    task:   NEW --Admit--> ACTIVE --Pause--> PAUSED --Resume--> ACTIVE --> FINISHED
                              \\________________________________________--> DROPPED (stale)
    group:  PENDING --> RUNNING --> READY (all tasks finished, rewards known) --> TRAINED
                                          \\--> DROPPED (too stale to train)

Decisions are plain data returned by policies (CTB, ERS); the runtime and the simulator each
apply them with their own adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

TaskId = str
GroupId = str


class Role(str, Enum):
    """What a rank does now; ERS changes it at the sync boundary."""

    ROLLOUT = "rollout"
    REF = "ref"
    ACTOR = "actor"
    IDLE = "idle"


class Placement(str, Enum):
    """RA2P's choice: where Ref runs relative to Actor."""

    DECOUPLED = "decoupled"  # Ref on its own ranks, streaming, loss deferred into backward
    COLOCATED = "colocated"  # Ref and Actor share ranks, ready micro-batches aggregated


class TaskState(str, Enum):
    NEW = "new"
    ACTIVE = "active"
    PAUSED = "paused"
    FINISHED = "finished"
    DROPPED = "dropped"


class GroupState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    READY = "ready"
    TRAINED = "trained"
    DROPPED = "dropped"


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True, slots=True)
class Task:
    """One agentic trajectory to run: an episode of environment ``env`` (its task type) drawn with
    ``seed``, in GRPO group ``group_id``. ``footprint_hint`` is its first-turn KV footprint in
    tokens when known in advance (e.g. the prompt's length); ``max_turns`` the most turns its
    episode runs, when known (its environment's turn limit)."""

    task_id: TaskId
    group_id: GroupId
    env: str
    is_eval: bool = False
    footprint_hint: int | None = None
    seed: int = 0
    max_turns: int | None = None


@dataclass(frozen=True, slots=True)
class Group:
    """The G tasks that share a prompt; advantages need all of them. The first is the probe of
    CTB's first-turn probing."""

    group_id: GroupId
    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        ids = [t.task_id for t in self.tasks]
        if not ids or len(set(ids)) < len(ids):
            raise ValueError(f"group {self.group_id!r} needs tasks with distinct ids")
        strays = [t.task_id for t in self.tasks if t.group_id != self.group_id]
        if strays:
            raise ValueError(f"tasks {strays} do not belong to group {self.group_id!r}")

    @property
    def size(self) -> int:
        return len(self.tasks)

    @property
    def is_eval(self) -> bool:
        return any(t.is_eval for t in self.tasks)


# --------------------------------------------------------------------------- trajectories


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image in a run of token ids: its ``num_tokens`` placeholder (image-pad) tokens start
    at ``offset``; ``key`` is the content hash of its pixels (the PNG bytes travel once per
    trajectory, keyed by it); ``grid`` is its (temporal, height, width) patch grid, which fixes
    the placeholders' multimodal positions."""

    key: str
    offset: int
    num_tokens: int
    grid: tuple[int, int, int]

    def shifted(self, by: int) -> ImageRef:
        return ImageRef(self.key, self.offset + by, self.num_tokens, self.grid)


@dataclass(slots=True)
class Turn:
    """One generation request of a task: the new context tokens and the model's action.

    ``context_ids`` are the tokens appended to the context before this turn (the first turn: the
    prompt; later turns: the environment's observation). ``output_ids`` are model tokens and are
    the only ones the loss is computed on. ``images``: the images among ``context_ids`` (offsets
    into them). ``restart``: the screenshot window pruned the context before this turn, so
    ``context_ids`` is the whole pruned context, and this turn opens a new training segment
    (:mod:`tiderl.core.segments`).
    """

    context_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    version: int
    images: tuple[ImageRef, ...] = ()
    restart: bool = False

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(
                f"turn has {len(self.output_ids)} output ids but {len(self.logprobs)} logprobs"
            )


@dataclass(slots=True)
class Segment:
    """One training sequence of a trajectory, flattened: ids, loss mask (1 on the model's
    tokens of this segment's turns), behaviour logprobs, per-token versions (-1 on context) and
    its images (offsets into ``ids``)."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    images: tuple[ImageRef, ...]


@dataclass(slots=True)
class Trajectory:
    """A finished (or in-progress) task's tokens, as the trainer consumes them."""

    task_id: TaskId
    group_id: GroupId
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    image_data: dict[str, bytes] = field(default_factory=dict)  # PNG bytes by ImageRef.key

    @property
    def num_tokens(self) -> int:
        return sum(len(t.context_ids) + len(t.output_ids) for t in self.turns)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    def oldest_version(self) -> int | None:
        return min((t.version for t in self.turns), default=None)

    def staleness(self, current_version: int) -> int:
        """current version minus the oldest version among its tokens (0 for an empty one)."""
        oldest = self.oldest_version()
        return 0 if oldest is None else current_version - oldest

    def flatten(self) -> tuple[list[int], list[int], list[float], list[int]]:
        """(input ids, loss mask, behaviour logprobs, versions), one entry per token, of a
        trajectory that is one training sequence (no ``restart`` turn past the first).

        Context tokens get mask 0, logprob 0.0 and version -1; model tokens mask 1.
        """
        segments = self.segments()
        if len(segments) != 1:
            raise ValueError(f"trajectory {self.task_id} has {len(segments)} segments")
        seg = segments[0]
        return seg.ids, seg.mask, seg.logprobs, seg.versions

    def segments(self) -> list[Segment]:
        """Its training sequences: a ``restart`` turn closes the one before it and opens the
        next, whose ids start from that turn's (whole, pruned) context."""
        segments: list[Segment] = []
        for turn in self.turns:
            if turn.restart or not segments:
                segments.append(Segment([], [], [], [], ()))
            seg = segments[-1]
            images = tuple(image.shifted(len(seg.ids)) for image in turn.images)
            n_ctx = len(turn.context_ids)
            seg.ids.extend(turn.context_ids)
            seg.mask.extend([0] * n_ctx)
            seg.logprobs.extend([0.0] * n_ctx)
            seg.versions.extend([-1] * n_ctx)
            seg.ids.extend(turn.output_ids)
            seg.mask.extend([1] * len(turn.output_ids))
            seg.logprobs.extend(turn.logprobs)
            seg.versions.extend([turn.version] * len(turn.output_ids))
            seg.images += images
        return segments


# --------------------------------------------------------------------------- trainer units


@dataclass(frozen=True, slots=True)
class SeqRef:
    """One trajectory as a trainer work item: its id and its token count."""

    seq_id: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """The unit the trainer consumes; ``ready_time`` is when its last sequence became ready."""

    mb_id: int
    sequences: tuple[SeqRef, ...]
    ready_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


@dataclass(frozen=True, slots=True)
class Ra2pTimings:
    """Per-micro-batch costs (seconds) that drive the RA2P cost models of paper Appendix A."""

    t_ref: float  # Ref forward
    t_act_f: float  # Actor forward
    t_act_b: float  # Actor backward
    t_swap: float  # one model swap (offload one model, load the other)

    def __post_init__(self) -> None:
        for name in ("t_ref", "t_act_f", "t_act_b", "t_swap"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class Admit:
    """Start a new task on ``rank`` (pin it there under CTB)."""

    task_id: TaskId
    rank: int


@dataclass(frozen=True, slots=True)
class Pause:
    """Take an active task off its rank: unpin its KV, /pause its environment session.
    ``released``: it waits for its environment longer than recomputing its context takes (CTB's
    release phase); it is resumed only once its environment answered."""

    task_id: TaskId
    released: bool = False


@dataclass(frozen=True, slots=True)
class Resume:
    """Put a paused task back on ``rank``: /resume its session, pin it again."""

    task_id: TaskId
    rank: int


Decision = Admit | Pause | Resume


@dataclass(frozen=True, slots=True)
class ReadinessSignals:
    """The global buffer's view at a step start (paper §5, App. A).

    ``ras``: micro-batches ready at step start (N0). ``tprm_s``: mean post-start gap between
    ready micro-batches (None when fewer than two post-start arrivals are known).
    ``hol_latency_s``: age of the oldest ready micro-batch. ``ready_volume``: ready samples.
    """

    ras: int
    tprm_s: float | None
    hol_latency_s: float
    ready_volume: int
    ready_tokens: int = 0


class PlanReason(str, Enum):
    COLD_START = "cold_start"
    EVALUATION = "evaluation"
    GENERATION_DEFICIT = "generation_deficit"
    CONSUMPTION_DEFICIT = "consumption_deficit"
    PHASE_END = "phase_end"  # a cold start or evaluation phase ended: its layout is undone
    BALANCED = "balanced"
    MANUAL = "manual"  # an operator's plan (``tiderl rebalance``), not ERS's signals
    TRIAL = "trial"  # a signal-driven move is being measured: its layout is held
    REVERT = "revert"  # the measured move did not raise goodput: it is undone
    PREDICTED = "predicted"  # the predictive planner's split (``ers.planner: predictive``)
    NO_ROLLOUT = "no_rollout"  # the last rollout rank died: a trainer rank moves to rollout
    TRAINER_LOST = "trainer_lost"  # a trainer rank died: the others go on without it


@dataclass(frozen=True, slots=True)
class RoleChange:
    rank: int
    src: Role
    dst: Role


@dataclass(frozen=True, slots=True)
class ScalingPlan:
    """ERS's decision at a post-update boundary: role moves, RA2P's placement, the batch size."""

    changes: tuple[RoleChange, ...]
    placement: Placement
    batch_size: int
    reason: PlanReason

    @property
    def is_noop(self) -> bool:
        return not self.changes
