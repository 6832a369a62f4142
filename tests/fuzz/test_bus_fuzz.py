"""A real CurveZMQ BusServer under 1,000 seeded bad messages from a peer holding a valid rank key
(bench/robustness_bus.py), with a stranger and a plain peer knocking: every bad message dropped,
none delivered, both intruders turned away, and valid messages still delivered afterwards."""

from __future__ import annotations

from bench.robustness_bus import KINDS, fuzz_bus

COUNT = 1000
SEED = 18


def test_every_bad_message_is_dropped_and_the_bus_serves_on() -> None:
    counts = fuzz_bus(count=COUNT, seed=SEED)
    assert counts["sent"] == COUNT
    assert sum(counts["by_kind"].values()) == COUNT and set(counts["by_kind"]) == set(KINDS)
    assert counts["delivered_bad"] == 0, counts
    assert counts["dropped"] == COUNT, counts
    assert counts["dropped_malformed"] > 0 and counts["dropped_forged"] > 0 \
        and counts["dropped_forbidden"] > 0, counts
    assert counts["delivered_valid_after"] == counts["valid_sent_after"] == 2, counts
    assert counts["rejected_peers"] == 2, counts
