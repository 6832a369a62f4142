"""The progress line of `tiderl launch`: which fields fit a terminal's width (the step counter
always does), from hand-built snapshots."""

from tiderl.cli.progress import progress_fields, progress_line
from tiderl.runtime.bus import Snapshot

METRICS = {"reward_mean": 0.1234, "goodput_tok_s": 357.4, "active": 24.0, "paused": 3.0}
ROLES = {0: "rollout", 1: "rollout", 2: "actor", 3: "ref"}


def snapshot(step: int) -> Snapshot:
    return Snapshot(step=step, time=12.0, roles=ROLES, metrics=METRICS, ranks=[],
                    step_mode="decoupled")


def test_every_field_in_display_order_without_a_width():
    fields = progress_fields(snapshot(12), 40, elapsed_s=83.0, eta_s=190.0)
    assert progress_line(fields, None) == (
        "step 12/40  1:23 eta 3:10  reward 0.123  goodput 357 tok/s  decoupled steps  "
        "roles actor 1 ref 1 rollout 2  tasks 24 active 3 paused")


def test_at_80_columns_the_least_important_fields_go_first():
    fields = progress_fields(snapshot(12), 40, elapsed_s=83.0, eta_s=190.0)
    line = progress_line(fields, 80)
    assert line == "step 12/40  1:23 eta 3:10  reward 0.123  goodput 357 tok/s  decoupled steps"
    assert progress_line(fields, 40) == "step 12/40  1:23 eta 3:10  reward 0.123"


def test_the_step_counter_shows_at_any_width():
    fields = progress_fields(snapshot(7), 40, elapsed_s=3725.0, eta_s=None)
    assert progress_line(fields, 5) == "step 7/40"
    assert progress_line(fields, 20) == "step 7/40  1:02:05"


def test_before_the_first_snapshot_and_after_the_last_step():
    assert progress_line(progress_fields(None, 40, 4.0, None), 80) == (
        "step 0/40  0:04  starting ...")
    last = progress_line(progress_fields(snapshot(40), 40, 100.0, 0.0), 80)
    assert last.startswith(
        "step 40/40  1:40 eta 0:00  finishing (the last weights, the report) ...")
    assert len(last) <= 80
