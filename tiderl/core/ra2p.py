"""RA2P: Ref-Actor placement choice, micro-batch formation and dispatch (paper §5.1, App. A).

Cost models over the sorted ready times ``a_1..a_N`` of a step's micro-batches, relative to the
step start (``a_i <= 0``: ready at the start; N0 of them is the RAS):

    C_dec = c_N,  c_0 = 0,
            c_i = max(max(c_{i-1}, a_i) + t_act_f + t_act_b,  r_i + t_act_b),
            r_i = max(r_{i-1}, a_i) + t_ref               (the Ref ranks' own queue)
    C_col = the clock after stepping App. A's aggregation loop (``cost_colocated``)

App. A writes C_dec as a fill bubble Σ_{i<M} i·t_ref (M actor ranks, each waiting for its own
micro-batch's Ref pass in turn) plus the closed sum Σ_i max(δ_i, t_act_f + t_act_b) with δ_i = 0
for the N0 micro-batches ready at the start and δ_{N0+1} = a_{N0+1}. Here every micro-batch is
dealt over all actor ranks and its Ref pass is what their backward waits for, so the first
pass's wait is ``r_1 + t_act_b`` in the recurrence and a separate bubble counts it again: on four
CPU ranks (``bench/ra2p.py``, 1 Ref and 3 actor ranks, 16 RAS x TPRM cells) the bubble made
C_dec overestimate the measured decoupled step by 3-14% in every cell; without it the error is
at most 3.2% in any cell.
The closed sum charges the wait for the first later micro-batch on top of the N0·(t_act_f +
t_act_b) the actors spend on the ready ones, although the two overlap, and it leaves out the last
micro-batch's own actor time when the gaps are long: stepping the queue counts each exactly once,
and the two agree when every micro-batch is ready at the start. App. A also leaves out that the
Ref ranks are a queue of their own: an actor's backward waits for its micro-batch's Ref pass (the
deferred loss), so when a Ref pass is longer than the actor's work (few Ref ranks for many
actors: a micro-batch of 24 ranks' tokens on one Ref GPU) the step is the Ref queue,
``r_N + t_act_b``. The ``r_i`` term changes nothing while ``t_ref <= t_act_f``.

Decoupled needs a dedicated Ref GPU, so it wins only when ``C_dec < (1 - margin)·C_col``; ties go
to colocated. With margin 0 (pure latency) decoupled wins at almost any RAS once TPRM exceeds
the actor time, because after the final arrival C_col pays two swaps and a Ref pass besides the
actor time; the paper calls the two latencies "comparable" there and prefers colocated for its
smaller footprint. The default margin of 0.1 (decoupled must save 10% of the step) restores
that: the break-even RAS is then 0 for short TPRM and near N for long TPRM.

Micro-batches: early ones are filled, in ready order, to ``tokens_per_rank · num_dp_ranks`` tokens
and at least one sequence per DP rank, so that every DP rank is saturated (with sequences longer
than ``tokens_per_rank``, as multimodal segments are, a token target alone would leave ranks
idle in every pass); the last one of a global batch holds the smallest sequences
(see ``form_micro_batches``). Dispatch: zig-zag over length-sorted sequences for colocated,
round-robin smallest-last for decoupled. Ties are broken by ``seq_id`` everywhere.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from tiderl.core.config import require, require_choice, require_positive
from tiderl.core.quote import short
from tiderl.core.types import MicroBatch, Placement, Ra2pTimings, SeqRef

PLACEMENT_CHOICES = ("auto", "decoupled", "colocated")
DEFAULT_DECOUPLED_MARGIN = 0.1


@dataclass(frozen=True, slots=True)
class RA2PConfig:
    """``placement``: "auto" (cost models decide) or a fixed placement. ``decoupled_margin``: the
    fraction of C_col decoupled must save to be chosen (0 = pure App. A latency comparison)."""

    placement: str = "auto"
    tokens_per_rank: int = 8192
    max_aggregate: int = 8
    num_ref_ranks: int = 1
    decoupled_margin: float = DEFAULT_DECOUPLED_MARGIN

    def __post_init__(self) -> None:
        require_choice(self.placement, PLACEMENT_CHOICES, "placement")
        require_positive(self.tokens_per_rank, "tokens_per_rank")
        require_positive(self.max_aggregate, "max_aggregate")
        require_positive(self.num_ref_ranks, "num_ref_ranks")
        margin = self.decoupled_margin
        message = f"expected a number in [0, 1), got {short(margin)}"
        require(0.0 <= margin < 1.0, "decoupled_margin", message)


# --------------------------------------------------------------------------- cost models


def _require_at_least_one(value: int, name: str) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {short(value)}")


def cost_decoupled(ready_times: Iterable[float], timings: Ra2pTimings) -> float:
    """C_dec for these ready times (relative to the step start, any order): the actors' and the
    Ref ranks' queues stepped micro-batch by micro-batch (see the module docstring for where
    this departs from App. A)."""
    busy = timings.t_act_f + timings.t_act_b
    clock = ref_done = 0.0
    for ready in sorted(ready_times):
        ref_done = max(ref_done, ready) + timings.t_ref
        clock = max(max(clock, ready) + busy, ref_done + timings.t_act_b)
    return clock


def cost_colocated(ready_times: Iterable[float], timings: Ra2pTimings, max_aggregate: int) -> float:
    """C_col of App. A: step the ready-batch aggregation loop and return the final clock."""
    _require_at_least_one(max_aggregate, "max_aggregate")
    times = sorted(ready_times)
    busy = timings.t_act_f + timings.t_act_b
    clock, j = 0.0, 0
    while j < len(times):
        clock = max(clock, times[j])  # 1. wait for data
        k = min(bisect_right(times, clock) - j, max_aggregate)  # 2. aggregate the ready ones
        clock += timings.t_swap + k * timings.t_ref  # 3. Ref over k micro-batches
        clock += timings.t_swap + k * busy  # 4. Actor over them
        j += k  # 5. advance
    return clock


def is_decoupled_cheaper(
    c_dec: float, c_col: float, margin: float = DEFAULT_DECOUPLED_MARGIN
) -> bool:
    """Decoupled wins only when strictly cheaper by the margin; ties go to colocated."""
    return c_dec < (1.0 - margin) * c_col


def choose_placement(
    ready_times: Iterable[float],
    timings: Ra2pTimings,
    max_aggregate: int,
    config: RA2PConfig | None = None,
    colocated_timings: Ra2pTimings | None = None,
) -> Placement:
    """The placement with the lower App. A cost, unless ``config.placement`` fixes one.

    ``timings`` are per micro-batch in the decoupled layout; ``colocated_timings``, when given,
    are those of the colocated layout (there Ref and Actor both run on every trainer rank, so a
    micro-batch's times differ from the decoupled layout's)."""
    config = config or RA2PConfig()
    if config.placement != "auto":
        return Placement(config.placement)
    times = list(ready_times)
    c_dec = cost_decoupled(times, timings)
    c_col = cost_colocated(times, colocated_timings or timings, max_aggregate)
    cheaper = is_decoupled_cheaper(c_dec, c_col, config.decoupled_margin)
    return Placement.DECOUPLED if cheaper else Placement.COLOCATED


def synthetic_ready_times(num_micro_batches: int, num_at_start: int, tprm_s: float) -> list[float]:
    """``num_at_start`` micro-batches ready at 0, the rest at ``tprm_s, 2·tprm_s, ...``."""
    num_later = num_micro_batches - num_at_start
    return [0.0] * num_at_start + [tprm_s * i for i in range(1, num_later + 1)]


def break_even_ras(
    num_micro_batches: int,
    tprm_s: float,
    timings: Ra2pTimings,
    max_aggregate: int,
    margin: float = DEFAULT_DECOUPLED_MARGIN,
    colocated_timings: Ra2pTimings | None = None,
) -> int | None:
    """The smallest RAS N0 in [0, N] at which decoupled wins (``is_decoupled_cheaper``) when the
    other N - N0 micro-batches arrive every ``tprm_s`` after the start; None if it never does.
    ``timings`` are the decoupled layout's, ``colocated_timings`` (default: the same) the
    colocated layout's, as in ``choose_placement``.

    C_col is not monotone in N0 (an earlier arrival can split an aggregate), so every N0 is
    tried in order: O(N²) in the worst case, ~1 ms for N = 64.
    """
    if num_micro_batches < 0 or tprm_s < 0:
        raise ValueError(f"need N >= 0 and tprm_s >= 0, got {num_micro_batches}, {tprm_s}")
    for num_at_start in range(num_micro_batches + 1):
        times = synthetic_ready_times(num_micro_batches, num_at_start, tprm_s)
        c_dec = cost_decoupled(times, timings)
        c_col = cost_colocated(times, colocated_timings or timings, max_aggregate)
        if is_decoupled_cheaper(c_dec, c_col, margin):
            return num_at_start
    return None


# --------------------------------------------------------------------------- micro-batches


def _smallest_first_key(seq: SeqRef) -> tuple[int, str]:
    return (seq.num_tokens, seq.seq_id)


def _longest_first(sequences: Iterable[SeqRef]) -> list[SeqRef]:
    return sorted(sequences, key=lambda s: (-s.num_tokens, s.seq_id))


def _tail_indices(sequences: list[SeqRef], num_dp_ranks: int, target: int) -> set[int]:
    """Indices of the last micro-batch: the smallest sequences, at most one per DP rank, while
    their tokens stay <= the target and <= the tokens left for the early micro-batches."""
    order = sorted(range(len(sequences)), key=lambda i: _smallest_first_key(sequences[i]))
    total = sum(s.num_tokens for s in sequences)
    chosen, tokens = [order[0]], sequences[order[0]].num_tokens
    for i in order[1:num_dp_ranks]:
        grown = tokens + sequences[i].num_tokens
        if grown > target or grown > total - grown:
            break
        chosen.append(i)
        tokens = grown
    return set(chosen)


def _fill_to_target(sequences: list[SeqRef], target: int, min_seqs: int) -> list[list[SeqRef]]:
    """Greedy chunks of ``target`` tokens or more and ``min_seqs`` sequences or more; a short
    remainder joins the chunk before it."""
    chunks: list[list[SeqRef]] = []
    current: list[SeqRef] = []
    tokens = 0
    for seq in sequences:
        current.append(seq)
        tokens += seq.num_tokens
        if tokens >= target and len(current) >= min_seqs:
            chunks.append(current)
            current, tokens = [], 0
    if current and chunks:
        chunks[-1].extend(current)
    elif current:
        chunks.append(current)
    return chunks


def _micro_batch(
    mb_id: int, sequences: list[SeqRef], ready_times: Mapping[str, float] | None
) -> MicroBatch:
    ready_time = max(ready_times[s.seq_id] for s in sequences) if ready_times else 0.0
    return MicroBatch(mb_id=mb_id, sequences=tuple(sequences), ready_time=ready_time)


def form_micro_batches(
    sequences: list[SeqRef],
    num_dp_ranks: int,
    tokens_per_rank: int,
    *,
    first_mb_id: int = 0,
    ready_times: Mapping[str, float] | None = None,
) -> list[MicroBatch]:
    """Split a known global batch (in ready order) into micro-batches.

    A batch of at most the token target (``tokens_per_rank · num_dp_ranks``) or of at most one
    sequence per DP rank is one micro-batch: splitting it would only add passes. Otherwise the
    last micro-batch holds the smallest sequences, at most one per DP rank: its duration is that
    of its largest sequence per rank, so a few small ones cost little flush time. It stops
    growing before it would exceed the target or the tokens left for the others, so it is never
    larger than any early micro-batch. The rest, in ready order, are filled to at least the
    target and a sequence per DP rank each (a short remainder joins the one before); only when
    they hold less than that in all is the single early one below it.
    ``ready_times`` (seq_id -> time) sets each micro-batch's ready time to its last sequence's.
    """
    _require_at_least_one(num_dp_ranks, "num_dp_ranks")
    _require_at_least_one(tokens_per_rank, "tokens_per_rank")
    if not sequences:
        return []
    target = tokens_per_rank * num_dp_ranks
    if sum(s.num_tokens for s in sequences) <= target or len(sequences) <= num_dp_ranks:
        # one pass cannot even saturate the ranks, or gives each rank one sequence at most
        return [_micro_batch(first_mb_id, list(sequences), ready_times)]
    tail = _tail_indices(sequences, num_dp_ranks, target)
    early = [s for i, s in enumerate(sequences) if i not in tail]
    groups = [*_fill_to_target(early, target, num_dp_ranks), [sequences[i] for i in sorted(tail)]]
    return [_micro_batch(first_mb_id + n, g, ready_times) for n, g in enumerate(groups)]


def next_micro_batch(
    ready: list[SeqRef],
    num_dp_ranks: int,
    tokens_per_rank: int,
    *,
    is_last: bool,
    mb_id: int = 0,
    ready_time: float = 0.0,
) -> MicroBatch | None:
    """The next micro-batch to stream from the ready sequences (in ready order), or None.

    Before the end of the global batch (``is_last=False``: more sequences will come) it is the
    shortest ready prefix holding the token target and a sequence per DP rank, or None while
    fewer are ready. With
    ``is_last=True`` (every remaining sequence is in ``ready``) it is the first micro-batch of
    ``form_micro_batches(ready)``, so the global batch still ends with its smallest sequences.
    The caller removes the returned sequences from ``ready``.
    """
    _require_at_least_one(num_dp_ranks, "num_dp_ranks")
    _require_at_least_one(tokens_per_rank, "tokens_per_rank")
    if is_last:
        planned = form_micro_batches(ready, num_dp_ranks, tokens_per_rank)
        return replace(planned[0], mb_id=mb_id, ready_time=ready_time) if planned else None
    target = tokens_per_rank * num_dp_ranks
    tokens = 0
    for n, seq in enumerate(ready, start=1):
        tokens += seq.num_tokens
        if tokens >= target and n >= num_dp_ranks:
            return MicroBatch(mb_id=mb_id, sequences=tuple(ready[:n]), ready_time=ready_time)
    return None


# --------------------------------------------------------------------------- dispatch


def dispatch_zigzag(sequences: Iterable[SeqRef], num_ranks: int) -> list[list[SeqRef]]:
    """Colocated dispatch: longest first, dealt in zig-zag order 0..R-1, R-1..0, 0..R-1, ...

    Rank loads (tokens) then differ by at most the largest sequence: within each forward sweep a
    lower rank gets the longer item, within each backward sweep the higher rank does, and the
    sorted order makes both sums of differences telescope below the largest item (checked by a
    hypothesis test, so plain zig-zag is kept and no LPT fallback is needed).
    """
    _require_at_least_one(num_ranks, "num_ranks")
    per_rank: list[list[SeqRef]] = [[] for _ in range(num_ranks)]
    for i, seq in enumerate(_longest_first(sequences)):
        sweep, position = divmod(i, num_ranks)
        rank = position if sweep % 2 == 0 else num_ranks - 1 - position
        per_rank[rank].append(seq)
    return per_rank


def order_smallest_last(sequences: Iterable[SeqRef], num_ranks: int) -> list[list[SeqRef]]:
    """Decoupled dispatch: longest first, dealt round-robin 0..R-1, 0..R-1, ...

    Each rank's list is longest-first, so it ends with its smallest; fed position by position
    across ranks (``feed_order``), the sequences enter the pipeline longest first and the very
    last one is the absolute smallest. Loads differ by at most the largest sequence.
    """
    _require_at_least_one(num_ranks, "num_ranks")
    per_rank: list[list[SeqRef]] = [[] for _ in range(num_ranks)]
    for i, seq in enumerate(_longest_first(sequences)):
        per_rank[i % num_ranks].append(seq)
    return per_rank


def feed_order(per_rank: list[list[SeqRef]]) -> list[SeqRef]:
    """Pipeline feed order of a dispatch: position 0 of ranks 0..R-1, then position 1, ..."""
    depth = max((len(seqs) for seqs in per_rank), default=0)
    return [seqs[p] for p in range(depth) for seqs in per_rank if p < len(seqs)]
