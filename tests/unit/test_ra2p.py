from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiderl.core.config import ConfigError
from tiderl.core.ra2p import (
    RA2PConfig,
    break_even_ras,
    choose_placement,
    cost_colocated,
    cost_decoupled,
    dispatch_zigzag,
    feed_order,
    form_micro_batches,
    is_decoupled_cheaper,
    next_micro_batch,
    order_smallest_last,
    synthetic_ready_times,
)
from tiderl.core.types import Placement, Ra2pTimings, SeqRef

FAST = settings(max_examples=200, deadline=None)
T = Ra2pTimings(t_ref=1.0, t_act_f=1.0, t_act_b=2.0, t_swap=0.5)  # actor busy time 3.0


# --------------------------------------------------------------------------- reference models
# Written independently of tiderl.core.ra2p, straight from the definitions of App. A.


def reference_decoupled(ready_times, timings):
    """C_dec: two servers in tandem over explicit arrival events: the Ref ranks (a FIFO, t_ref
    each) and the actors (a FIFO, t_act_f + t_act_b each), whose backward cannot start before
    that micro-batch's Ref pass is done (every micro-batch is dealt over all actor ranks)."""
    ref_done, ref_clock = [], 0.0
    for arrival in sorted(ready_times):  # the Ref server
        ref_clock = (ref_clock if ref_clock > arrival else arrival) + timings.t_ref
        ref_done.append(ref_clock)
    arrivals = deque(sorted(ready_times))
    queued: deque[int] = deque()
    clock, i = 0.0, 0
    while arrivals or queued:
        while arrivals and arrivals[0] <= clock:
            arrivals.popleft()
            queued.append(i)
            i += 1
        if not queued:
            clock = arrivals[0]  # idle until the next arrival event
            continue
        j = queued.popleft()
        forward_done = clock + timings.t_act_f
        clock = (forward_done if forward_done > ref_done[j] else ref_done[j]) + timings.t_act_b
    return clock


def reference_colocated(ready_times, timings, max_aggregate):
    """C_col: a clock over explicit arrival events and a FIFO of arrived micro-batches."""
    arrivals = deque(sorted(ready_times))
    arrived: list[float] = []
    clock = 0.0
    while arrivals or arrived:
        while arrivals and arrivals[0] <= clock:
            arrived.append(arrivals.popleft())
        if not arrived:
            clock = arrivals[0]  # idle until the next arrival event
            continue
        batch, arrived = arrived[:max_aggregate], arrived[max_aggregate:]
        clock = clock + timings.t_swap + len(batch) * timings.t_ref
        clock = clock + timings.t_swap + len(batch) * (timings.t_act_f + timings.t_act_b)
    return clock


# Dyadic values (multiples of 1/8) keep every sum exact, so ties compare the same in both models.
dyadic_times = st.lists(st.integers(-80, 400).map(lambda x: x / 8), max_size=40)
dyadic_timings = st.builds(
    Ra2pTimings, *[st.integers(0, 40).map(lambda x: x / 8) for _ in range(4)]
)


@FAST
@given(dyadic_times, dyadic_timings)
def test_decoupled_cost_matches_reference(times, timings):
    expected = reference_decoupled(times, timings)
    assert cost_decoupled(times, timings) == pytest.approx(expected, abs=1e-9)


@FAST
@given(dyadic_times, dyadic_timings, st.integers(1, 12))
def test_colocated_cost_matches_reference(times, timings, max_aggregate):
    expected = reference_colocated(times, timings, max_aggregate)
    assert cost_colocated(times, timings, max_aggregate) == pytest.approx(expected, abs=1e-9)


def test_costs_by_hand():
    times = [5.0, -2.0, 6.0, 0.0, 1.0]  # N0 = 2 (-2 and 0); order does not matter
    # the queue: the two ready ones end at 3 and 6, the one at 1 at 9, 5 -> 12, 6 -> 15
    assert cost_decoupled(times, T) == 15.0
    # T=0: k=2 -> 0.5+2, 0.5+6 -> 9; k=3 (1, 5, 6 <= 9) -> 9+0.5+3+0.5+9 = 22
    assert cost_colocated(times, T, max_aggregate=8) == 22.0
    # cap 2: 9; k=2 -> 18; k=1 -> 18+0.5+1+0.5+3 = 23
    assert cost_colocated(times, T, max_aggregate=2) == 23.0


def test_decoupled_cost_has_no_separate_fill_bubble():
    # every micro-batch is dealt over all actor ranks: the first one's backward waits for its
    # Ref pass (done at 11) and ends at 13, which is all the pipeline's fill costs; the last
    # arrives at 30 and ends at 33 (App. A's bubble, 0 + 1 + 2 for three actors, would add 3:
    # bench/ra2p.py measured the step without it)
    assert cost_decoupled([10.0, 20.0, 30.0], T) == 33.0
    assert cost_decoupled([], T) == 0.0
    assert cost_colocated([], T, max_aggregate=4) == 0.0


def test_colocated_cost_refuses_zero_aggregate():
    with pytest.raises(ValueError, match="max_aggregate"):
        cost_colocated([0.0], T, 0)


# --------------------------------------------------------------------------- mode choice

PURE = RA2PConfig(decoupled_margin=0.0)


def test_choose_placement_by_hand():
    times = [5.0, -2.0, 6.0, 0.0, 1.0]  # C_dec 15 < C_col 22
    assert choose_placement(times, T, 8, PURE) is Placement.DECOUPLED
    assert choose_placement(times, T, 8) is Placement.DECOUPLED
    # long gaps: C_dec = 33 < C_col = 30 + 0.5 + 1 + 0.5 + 3 = 35, but not by 10%
    assert choose_placement([10.0, 20.0, 30.0], T, 8, PURE) is Placement.DECOUPLED
    assert choose_placement([10.0, 20.0, 30.0], T, 8) is Placement.COLOCATED


def test_tie_goes_to_colocated():
    no_swap = Ra2pTimings(t_ref=0.0, t_act_f=1.0, t_act_b=2.0, t_swap=0.0)
    assert cost_decoupled([0.0], no_swap) == cost_colocated([0.0], no_swap, 1) == 3.0
    assert choose_placement([0.0], no_swap, 1, PURE) is Placement.COLOCATED
    assert choose_placement([], T, 1, PURE) is Placement.COLOCATED


def test_fixed_placement_is_honoured():
    times = [5.0, -2.0, 6.0, 0.0, 1.0]
    colocated, decoupled = RA2PConfig(placement="colocated"), RA2PConfig(placement="decoupled")
    assert choose_placement(times, T, 8, colocated) is Placement.COLOCATED
    assert choose_placement([0.0], T, 1, decoupled) is Placement.DECOUPLED


@FAST
@given(dyadic_times, dyadic_timings, st.integers(1, 8))
def test_choose_placement_picks_the_lower_cost(times, timings, max_aggregate):
    c_dec = reference_decoupled(times, timings)
    c_col = reference_colocated(times, timings, max_aggregate)
    mode = choose_placement(times, timings, max_aggregate, PURE)
    assert mode is (Placement.DECOUPLED if c_dec < c_col else Placement.COLOCATED)


def test_break_even_by_hand():
    timings = Ra2pTimings(t_ref=1.0, t_act_f=1.0, t_act_b=2.0, t_swap=0.5)
    # N0=0: [8,16,24] dec 27 < col 29, not by 10%; N0=1: [0,8,16] dec 19, col 21, not by 10%
    # (18.9); N0=2: [0,0,8] dec 11 < 0.9 x col 14 -> decoupled.
    assert break_even_ras(3, 8.0, timings, 8, margin=0.0) == 0
    assert break_even_ras(3, 8.0, timings, 8, margin=0.1) == 2
    assert synthetic_ready_times(3, 1, 8.0) == [0.0, 8.0, 16.0]


def test_a_slow_ref_queue_bounds_the_decoupled_step():
    # One Ref rank for many actors: a Ref pass of 4 s against 3 s of actor work. The Ref queue
    # ends at 4, 8, 12 and each backward (2 s) waits for it: 6, 10, 14.
    slow_ref = Ra2pTimings(t_ref=4.0, t_act_f=1.0, t_act_b=2.0, t_swap=0.5)
    assert cost_decoupled([0.0, 0.0, 0.0], slow_ref) == 14.0
    # the colocated layout runs the Ref pass on every actor: 1 s each, one swap pair (29, 21, 14
    # and 13 s with 0..3 ready, against the decoupled 30, 22, 14 and 14: a tie at best)
    colocated = Ra2pTimings(t_ref=1.0, t_act_f=1.0, t_act_b=2.0, t_swap=0.5)
    assert break_even_ras(3, 8.0, slow_ref, 8, margin=0.0,
                          colocated_timings=colocated) is None


def test_break_even_follows_tprm():
    # margin 0.1: short TPRM keeps the decoupled pipeline fed from the start; long TPRM needs
    # nearly the whole batch ready.
    assert break_even_ras(16, 0.5, T, 8) == 0
    assert break_even_ras(16, 10.0, T, 8) == 11
    assert break_even_ras(16, 30.0, T, 8) == 15


@FAST
@given(
    st.integers(0, 24),
    st.integers(0, 80).map(lambda x: x / 4),
    dyadic_timings,
    st.integers(1, 8),
    st.sampled_from([0.0, 0.1, 0.25]),
)
def test_break_even_is_consistent_with_costs(n, tprm, timings, cap, margin):
    def dec_wins(n0):
        times = synthetic_ready_times(n, n0, tprm)
        c_dec = reference_decoupled(times, timings)
        return is_decoupled_cheaper(c_dec, reference_colocated(times, timings, cap), margin)

    result = break_even_ras(n, tprm, timings, cap, margin)
    if result is None:
        assert not any(dec_wins(n0) for n0 in range(n + 1))
    else:
        assert dec_wins(result)
        assert not any(dec_wins(n0) for n0 in range(result))


def test_config_validation():
    with pytest.raises(ConfigError) as error:
        RA2PConfig(placement="fast")
    assert error.value.key == "placement"
    for field in ("tokens_per_rank", "max_aggregate", "num_ref_ranks"):
        with pytest.raises(ConfigError) as error:
            RA2PConfig(**{field: 0})
        assert error.value.key == field
    with pytest.raises(ConfigError) as error:
        RA2PConfig(decoupled_margin=1.0)
    assert error.value.key == "decoupled_margin"


# --------------------------------------------------------------------------- micro-batches


def seqs(*sizes: int) -> list[SeqRef]:
    return [SeqRef(f"s{i}", n) for i, n in enumerate(sizes)]


def ids(mb) -> list[str]:
    return [s.seq_id for s in mb.sequences]


def test_formation_by_hand():
    # target 2 x 100 = 200; held back for the end: s5 (20) and s2 (30), one per DP rank
    mbs = form_micro_batches(seqs(150, 80, 30, 120, 60, 20, 90), 2, 100)
    assert [ids(mb) for mb in mbs] == [["s0", "s1"], ["s3", "s4", "s6"], ["s2", "s5"]]
    assert [mb.num_tokens for mb in mbs] == [230, 270, 50]
    assert [mb.mb_id for mb in mbs] == [0, 1, 2]


def test_short_remainder_joins_the_previous_micro_batch():
    mbs = form_micro_batches(seqs(150, 80, 30, 120, 60, 20, 90, 10), 2, 100, first_mb_id=7)
    # s2+s3+s4 = 210 fills the second one; s6 (90) is left over and joins it
    assert [ids(mb) for mb in mbs] == [["s0", "s1"], ["s2", "s3", "s4", "s6"], ["s5", "s7"]]
    assert [mb.num_tokens for mb in mbs] == [230, 300, 30]
    assert [mb.mb_id for mb in mbs] == [7, 8, 9]


def test_a_batch_below_the_target_is_one_micro_batch():
    mbs = form_micro_batches(seqs(50, 40, 30), 4, 100)
    assert [ids(mb) for mb in mbs] == [["s0", "s1", "s2"]]
    assert [ids(mb) for mb in form_micro_batches(seqs(500), 1, 100)] == [["s0"]]
    assert form_micro_batches([], 4, 100) == []


def test_tail_never_outgrows_the_rest():
    # 410 > target 400; a tail of 60+150 = 210 would outgrow the 200 left, so it stays at 60
    mbs = form_micro_batches(seqs(200, 150, 60), 2, 200)
    assert [ids(mb) for mb in mbs] == [["s0", "s1"], ["s2"]]
    # here the tail takes one small sequence per DP rank: 30+30+40+50 = 150 <= 300 left
    mbs = form_micro_batches(seqs(50, 40, 30, 300, 30), 4, 100)
    assert [ids(mb) for mb in mbs] == [["s3"], ["s0", "s1", "s2", "s4"]]


def test_sequences_longer_than_the_target_still_fill_every_rank():
    # 500-token sequences, 4 DP ranks of 100 tokens: each early micro-batch holds one per rank
    mbs = form_micro_batches(seqs(*[500] * 10), 4, 100)
    assert [len(mb.sequences) for mb in mbs] == [4, 5, 1]
    assert form_micro_batches(seqs(500, 500, 500), 4, 100) == form_micro_batches(
        seqs(500, 500, 500), 4, 10_000)  # fewer sequences than ranks: one pass
    ready = seqs(*[500] * 5)
    assert next_micro_batch(ready[:3], 4, 100, is_last=False) is None
    assert len(next_micro_batch(ready, 4, 100, is_last=False).sequences) == 4


def test_ready_time_is_the_last_sequence_ready():
    ready = {"s0": 3.0, "s1": 1.0, "s2": 2.0}
    mbs = form_micro_batches(seqs(300, 300, 10), 1, 100, ready_times=ready)
    assert [(ids(mb), mb.ready_time) for mb in mbs] == [
        (["s0"], 3.0),
        (["s1"], 1.0),
        (["s2"], 2.0),
    ]


sequence_lists = st.lists(st.integers(1, 500), max_size=40).map(lambda sizes: seqs(*sizes))


@FAST
@given(sequence_lists, st.integers(1, 8), st.integers(1, 300))
def test_formation_properties(sequences, num_dp_ranks, tokens_per_rank):
    mbs = form_micro_batches(sequences, num_dp_ranks, tokens_per_rank)
    flat = [s for mb in mbs for s in mb.sequences]
    assert sorted(flat, key=lambda s: s.seq_id) == sorted(sequences, key=lambda s: s.seq_id)
    if len(mbs) < 2:
        return
    target = num_dp_ranks * tokens_per_rank
    *early, last = mbs
    early_tokens = sum(mb.num_tokens for mb in early)
    for mb in early:  # below target only when the early sequences run out before one is full
        assert mb.num_tokens >= target or (len(early) == 1 and early_tokens < target)
    assert all(last.num_tokens <= mb.num_tokens for mb in early)
    assert len(last.sequences) <= num_dp_ranks
    early_ids = [s.seq_id for mb in early for s in mb.sequences]
    assert early_ids == [s.seq_id for s in sequences if s.seq_id in set(early_ids)]


def test_next_micro_batch_streams_prefixes():
    ready = seqs(80, 50, 90, 10)
    assert next_micro_batch(ready[:2], 2, 100, is_last=False) is None  # 130 < 200
    mb = next_micro_batch(ready, 2, 100, is_last=False, mb_id=4, ready_time=9.5)
    assert (ids(mb), mb.mb_id, mb.ready_time) == (["s0", "s1", "s2"], 4, 9.5)
    assert next_micro_batch([], 2, 100, is_last=True) is None


def test_next_micro_batch_drains_the_end_smallest_last():
    ready = seqs(150, 80, 30, 120, 60, 20, 90)
    drained = []
    while ready:
        mb = next_micro_batch(ready, 2, 100, is_last=True, mb_id=len(drained))
        drained.append(ids(mb))
        ready = [s for s in ready if s not in mb.sequences]
    assert drained == [["s0", "s1"], ["s3", "s4", "s6"], ["s2", "s5"]]


# --------------------------------------------------------------------------- dispatch


def loads(per_rank) -> list[int]:
    return [sum(s.num_tokens for s in seqs_) for seqs_ in per_rank]


def test_zigzag_by_hand():
    per_rank = dispatch_zigzag(seqs(1, 5, 3, 4, 2), 2)
    # longest first: 5 -> r0, 4 -> r1, 3 -> r1, 2 -> r0, 1 -> r0
    assert [[s.num_tokens for s in r] for r in per_rank] == [[5, 2, 1], [4, 3]]


def test_zigzag_breaks_ties_by_seq_id():
    per_rank = dispatch_zigzag([SeqRef("b", 5), SeqRef("a", 5), SeqRef("c", 5)], 2)
    assert [[s.seq_id for s in r] for r in per_rank] == [["a"], ["b", "c"]]


heavy_tailed = st.lists(
    st.one_of(st.integers(1, 10), st.integers(1, 2000), st.sampled_from([1, 1024, 4096])),
    max_size=60,
).map(lambda sizes: seqs(*sizes))


@FAST
@given(heavy_tailed, st.integers(1, 9))
def test_zigzag_balances_within_the_largest_item(sequences, num_ranks):
    per_rank = dispatch_zigzag(sequences, num_ranks)
    assert len(per_rank) == num_ranks
    assert sorted(s.seq_id for r in per_rank for s in r) == sorted(s.seq_id for s in sequences)
    if sequences:
        largest = max(s.num_tokens for s in sequences)
        assert max(loads(per_rank)) - min(loads(per_rank)) <= largest


def test_smallest_last_by_hand():
    per_rank = order_smallest_last(seqs(1, 5, 3, 4, 2), 2)
    assert [[s.num_tokens for s in r] for r in per_rank] == [[5, 3, 1], [4, 2]]
    assert [s.num_tokens for s in feed_order(per_rank)] == [5, 4, 3, 2, 1]


@FAST
@given(heavy_tailed, st.integers(1, 9))
def test_smallest_last_properties(sequences, num_ranks):
    per_rank = order_smallest_last(sequences, num_ranks)
    fed = feed_order(per_rank)
    assert sorted(s.seq_id for s in fed) == sorted(s.seq_id for s in sequences)
    for rank_seqs in per_rank:
        if rank_seqs:
            assert rank_seqs[-1].num_tokens == min(s.num_tokens for s in rank_seqs)
    if sequences:
        assert fed[-1].num_tokens == min(s.num_tokens for s in sequences)
        largest = max(s.num_tokens for s in sequences)
        assert max(loads(per_rank)) - min(loads(per_rank)) <= largest
