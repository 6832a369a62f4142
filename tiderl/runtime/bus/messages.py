"""Bus wire format and message types: typed msgspec structs, never pickle, never dict bags.

Framing. Every message is exactly three ZeroMQ frames (a ROUTER prepends the peer identity on
receive and consumes it on send; callers of :mod:`sockets` never see it)::

    [kind: 1 byte] [schema version: 1 byte] [payload: msgpack map of the struct's fields]

The kind frame comes first and alone so a SUB socket can filter on it (ZeroMQ matches
subscriptions against the first frame) and a router can dispatch without decoding. The version
has its own frame so a peer of another TideRL version is refused with a clear line before the
payload is looked at. Kinds are grouped by sender: 0x01-0x0f rank → coordinator
(:data:`RANK_MESSAGES`), 0x10-0x1f operator CLI → coordinator (:data:`OPERATOR_MESSAGES`),
0x20-0x3f coordinator → rank or CLI, 0x40- coordinator PUB. Rank messages carry ``rank``: the bus
server drops one whose ``rank`` or ROUTER identity is not its CURVE key's rank, and the
coordinator checks it against the identity again. Operator messages (``Rebalance``) do not: the
operator key proves the sender, and the answer goes to its identity. Whose key may send which
group is the bus server's rule (:func:`tiderl.runtime.bus.gatekeeper.refusal`).

Any violation (wrong frame count, unknown kind, other schema version, a payload that does not
decode into the kind's struct) raises :class:`BusProtocolError` with one line naming the kind,
version or field; the sockets log and drop such a message and keep serving.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from tiderl.core.quote import short
from tiderl.core.system import StepMode

SCHEMA_VERSION = 2  # 2: steps have attempts (StepFailed, AbortStep)


class BusProtocolError(ValueError):
    """A message that does not follow the bus wire format; the receiver drops it."""


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every top-level bus message; ``kind`` is its one-byte wire tag (class-level).

    msgspec does not inherit ``kw_only``, so each message class repeats it."""

    kind: ClassVar[int]


# --- rank -> coordinator ---------------------------------------------------------------------

class Hello(Message, kw_only=True):
    """First message of a rank daemon: who it is, so the coordinator can map identity to rank."""

    kind: ClassVar[int] = 0x01
    rank: int
    pid: int
    host: str
    role: str
    device: str
    feed: str = ""  # host:port of its weight feed, where the others fetch what it publishes


class Heartbeat(Message, kw_only=True):
    """Liveness beacon; ``sent_at`` is the rank's wall clock, for lag diagnostics only."""

    kind: ClassVar[int] = 0x02
    rank: int
    sent_at: float


class TurnReport(Message, kw_only=True):
    """One generated turn of a task: feeds CTB's footprints (``context_tokens``) and goodput."""

    kind: ClassVar[int] = 0x03
    rank: int
    task_id: str
    tokens: int
    context_tokens: int
    done: bool
    version: int
    running: bool = True  # False: the turn's generation is done, the task waits for its env
    reused_tokens: int = 0  # after a generation: its prompt's tokens found cached, of
    reusable_tokens: int = 0  # the previous turn's context in whole blocks (agent.TurnEvent)


class ImageRefData(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An image among a turn's or a sample's ids (:class:`tiderl.core.types.ImageRef`)."""

    key: str
    offset: int
    num_tokens: int
    grid: tuple[int, int, int]


class TurnData(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One turn of a finished trajectory (nested in :class:`TaskFinished`, not a message)."""

    context_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    version: int
    images: list[ImageRefData] = []
    restart: bool = False


class TaskFinished(Message, kw_only=True):
    """A finished trajectory with its reward; the coordinator files it into its group."""

    kind: ClassVar[int] = 0x04
    rank: int
    task_id: str
    group_id: str
    reward: float
    turns: list[TurnData]
    num_tokens: int
    image_data: dict[str, bytes] = {}  # PNG bytes of the turns' images, by ImageRefData.key
    error: str = ""  # why the task failed (it ended with reward 0), if it did


class CarryData(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A task in flight moving between ranks: its open environment session, the turns played and
    the context its next turn starts from (nested, not a message)."""

    session: str
    turns: list[TurnData]
    next_context: list[int]
    next_images: list[ImageRefData] = []  # offsets into next_context
    next_restart: bool = False
    image_data: dict[str, bytes] = {}
    # an agent's next request asks for this sampling (max_tokens, stop, stop_token_ids, seed)
    next_sampling: dict[str, int | list[str | int]] = {}


class TaskDetached(Message, kw_only=True):
    """The rank stopped a task at a turn boundary to leave the rollout role; ``carry`` lets
    another rank go on with it (an AdmitTask with the carry)."""

    kind: ClassVar[int] = 0x05
    rank: int
    task_id: str
    carry: CarryData


class Ack(Message, kw_only=True):
    """Answer to a coordinator command: ``ref`` is that command's ``seq``."""

    kind: ClassVar[int] = 0x06
    rank: int
    ref: int
    ok: bool
    error: str = ""


class StepDone(Message, kw_only=True):
    """A trainer rank finished its share of attempt ``attempt`` of optimizer step ``step``;
    ``version`` is the new one."""

    kind: ClassVar[int] = 0x07
    rank: int
    step: int
    version: int
    step_mode: str
    loss: float
    loss_tokens: int
    grad_norm: float
    seconds: float
    stats: dict[str, float] = {}
    attempt: int = 0


class StepFailed(Message, kw_only=True):
    """A trainer rank's share of attempt ``attempt`` of step ``step`` failed (a collective with a
    rank that died, or an :class:`AbortStep`); ``updated``: it had stepped its optimizer."""

    kind: ClassVar[int] = 0x09
    rank: int
    step: int
    attempt: int
    updated: bool
    error: str


class RankMetrics(Message, kw_only=True):
    """A rank's engine gauges; also nested in :class:`Snapshot` for ``tiderl top``."""

    kind: ClassVar[int] = 0x08
    rank: int
    role: str
    kv_tokens_used: int
    kv_tokens_capacity: int  # the KV tokens its engine's cache holds (0: no engine)
    prefix_hit_rate: float
    running: int
    waiting: int
    prefix_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of them, found cached
    prefill_tokens_per_s: float = 0.0  # the engine's measured prefill rate (0: not measured)


# --- tiderl CLI -> coordinator ---------------------------------------------------------------

class Rebalance(Message, kw_only=True):
    """``tiderl rebalance``: a manual ERS layout of ``rollout`` + ``trainer`` ranks (RA2P's
    ``placement`` decoupled | colocated, "" keeps the current one), applied at the next
    post-update boundary and then held; ``auto`` hands the layout back to ERS (the counts are
    ignored). Answered by :class:`RebalanceReply` s with ``ref`` = ``seq``."""

    kind: ClassVar[int] = 0x10
    seq: int
    rollout: int = 0
    trainer: int = 0
    placement: str = ""
    auto: bool = False


# --- coordinator -> rank (``seq`` is echoed back as Ack.ref) ---------------------------------

class AdmitTask(Message, kw_only=True):
    """Start a task on this rank (a CTB decision); with ``carry``, go on with a task that ran on
    another rank (CTB resumed it here)."""

    kind: ClassVar[int] = 0x20
    seq: int
    task_id: str
    group_id: str
    env: str
    task: str = ""
    seed: int
    eval: bool = False
    pin: bool = False  # keep its KV pinned between turns (CTB pins, the request level does not)
    carry: CarryData | None = None


class PauseTask(Message, kw_only=True):
    """Pause a task at its next turn boundary (a CTB decision)."""

    kind: ClassVar[int] = 0x21
    seq: int
    task_id: str


class DetachTask(Message, kw_only=True):
    """Stop a task at its next turn boundary and send it back as :class:`TaskDetached` (it goes on
    on another rank)."""

    kind: ClassVar[int] = 0x23
    seq: int
    task_id: str


class ResumeTask(Message, kw_only=True):
    """Resume a paused task on this rank (a CTB decision)."""

    kind: ClassVar[int] = 0x22
    seq: int
    task_id: str


class SyncWeights(Message, kw_only=True):
    """The post-update boundary of ``version``: every rank takes ``roles[rank]`` (an ERS plan);
    ``src_rank`` publishes the weights on its feed (at ``source``, its host:port), and each rank
    that needs them fetches them from there on its own: a rank that rolls out, and ``joiners``
    (new actor ranks), which fetch the optimizer state too."""

    kind: ClassVar[int] = 0x24
    seq: int
    version: int
    src_rank: int
    roles: list[str]
    members: list[int]  # the live ranks that take this boundary (a dead one is left out)
    joiners: list[int] = []
    checkpoint: str = ""  # a folder: the actors save a checkpoint of ``version`` there first
    export: str = ""  # a folder: the source writes the weights there as hf/step-N (HF format)
    source: str = ""  # host:port of the source's weight feed


class TrainSampleData(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One training sequence of a step (nested in :class:`MicroBatchData`, not a message)."""

    seq_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    advantage: float
    version: int
    images: list[ImageRefData] = []
    image_data: dict[str, bytes] = {}


class TrainStep(Message, kw_only=True):
    """Open optimizer step ``step`` with this RA2P layout; its micro-batches follow as
    :class:`MicroBatchData` as the global buffer forms them, then :class:`StepClosed`."""

    kind: ClassVar[int] = 0x25
    seq: int
    step: int
    step_mode: StepMode
    ref_ranks: list[int]
    actor_ranks: list[int]
    max_aggregate: int  # micro-batches per colocated Ref/Actor round (0: no bound)
    attempt: int = 0  # > 0: the step again, after a trainer rank died in the one before


class MicroBatchData(Message, kw_only=True):
    """One micro-batch of the open step, its sequences in the buffer's order."""

    kind: ClassVar[int] = 0x26
    seq: int
    step: int
    mb_id: int
    samples: list[TrainSampleData]
    attempt: int = 0


class StepClosed(Message, kw_only=True):
    """The global batch of ``step`` is complete: no micro-batch follows."""

    kind: ClassVar[int] = 0x28
    seq: int
    step: int
    attempt: int = 0


class AbortStep(Message, kw_only=True):
    """Drop attempt ``attempt`` of step ``step`` (a trainer rank of it died): a rank still in
    it answers :class:`StepFailed` (or :class:`StepDone`, had it finished)."""

    kind: ClassVar[int] = 0x29
    seq: int
    step: int
    attempt: int


class Shutdown(Message, kw_only=True):
    """Stop the rank daemon cleanly."""

    kind: ClassVar[int] = 0x27
    seq: int
    reason: str


# --- coordinator -> tiderl CLI ---------------------------------------------------------------

class RebalanceReply(Message, kw_only=True):
    """An answer to :class:`Rebalance` ``ref``: "refused" (``reason`` says why; final),
    "accepted" (it applies at the boundary after ``step``), then "applied" (at ``version``, with
    the new ``roles``) or, if the job changed in between, "refused"."""

    kind: ClassVar[int] = 0x30
    ref: int
    status: str  # accepted | refused | applied
    reason: str = ""
    step: int = 0
    version: int = 0
    roles: list[str] = []
    placement: str = ""  # the RA2P placement the plan runs (applied)


# --- coordinator PUB -------------------------------------------------------------------------

class Snapshot(Message, kw_only=True):
    """The coordinator's periodic metrics snapshot, what ``tiderl top`` displays."""

    kind: ClassVar[int] = 0x40
    step: int
    time: float
    roles: dict[int, str]
    metrics: dict[str, float]
    ranks: list[RankMetrics]
    step_mode: str = ""  # the RA2P mode of the last step
    note: str = ""  # for operators: a pending or the last manual plan (tiderl rebalance)
    ctb_budgets: dict[int, int] = {}  # rollout rank -> CTB's token budget B_r there


MESSAGES: tuple[type[Message], ...] = (
    Hello, Heartbeat, TurnReport, TaskFinished, TaskDetached, Ack, StepDone, StepFailed,
    RankMetrics, AdmitTask, PauseTask, DetachTask, ResumeTask, SyncWeights, TrainStep,
    MicroBatchData, Shutdown, StepClosed, AbortStep, Snapshot, Rebalance, RebalanceReply,
)


RANK_MESSAGES: tuple[type[Message], ...] = tuple(m for m in MESSAGES if 0x01 <= m.kind <= 0x0F)
OPERATOR_MESSAGES: tuple[type[Message], ...] = tuple(
    m for m in MESSAGES if 0x10 <= m.kind <= 0x1F)


def _by_kind(messages: tuple[type[Message], ...]) -> dict[int, type[Message]]:
    table: dict[int, type[Message]] = {}
    for cls in messages:
        if not 0 <= cls.kind <= 0xFF or cls.kind in table:
            raise RuntimeError(f"bus message {cls.__name__}: kind {cls.kind:#04x} is not a "
                               "free byte")
        if (cls in RANK_MESSAGES) != ("rank" in cls.__struct_fields__) and cls.kind < 0x20:
            raise RuntimeError(f"bus message {cls.__name__}: kinds 0x01-0x0f (a rank's) "
                               "have a rank field, 0x10-0x1f (the operator's) none")
        table[cls.kind] = cls
    return table


_BY_KIND = _by_kind(MESSAGES)
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in _BY_KIND.items()}
_KIND_FRAMES = {cls: bytes([kind]) for kind, cls in _BY_KIND.items()}
_VERSION_FRAME = bytes([SCHEMA_VERSION])
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: Message) -> list[bytes]:
    """The three frames of ``msg``; a TypeError for a struct that is not a registered message."""
    kind_frame = _KIND_FRAMES.get(type(msg))
    if kind_frame is None:
        raise TypeError(f"{type(msg).__name__} is not a bus message (see messages.MESSAGES)")
    return [kind_frame, _VERSION_FRAME, _ENCODER.encode(msg)]


def decode(frames: list[bytes]) -> Message:
    """The message in ``frames`` (kind, version, payload); BusProtocolError if malformed."""
    if len(frames) != 3:
        raise BusProtocolError(f"expected 3 frames [kind, version, payload], got {len(frames)}")
    kind_frame, version_frame, payload = frames
    if len(kind_frame) != 1 or kind_frame[0] not in _BY_KIND:
        raise BusProtocolError(f"unknown message kind {short(bytes(kind_frame))}")
    kind = kind_frame[0]
    name = f"{_BY_KIND[kind].__name__} (kind {kind:#04x})"
    if version_frame != _VERSION_FRAME:
        got = int.from_bytes(version_frame, "big")
        raise BusProtocolError(f"{name}: schema version {got}, "
                               f"expected {SCHEMA_VERSION} (peer runs another TideRL version?)")
    try:
        return _DECODERS[kind].decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError; its text names $.field
        raise BusProtocolError(f"{name}: bad payload: {exc}") from None
