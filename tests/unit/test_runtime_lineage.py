"""A run folder's live lineage and its groups' fates, on hand-written metrics.jsonl and
events.jsonl pairs holding what a resume discarded (real files; the coordinator writes the same
events in tests/chaos/test_resume_lineage.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.test_runtime_report import _metrics, _write_jsonl
from tiderl.launch.run_folders import last_stop_in
from tiderl.runtime.group_fates import Fate, fates_of, group_fates
from tiderl.runtime.lineage import count_rows, live_lineage, read_jsonl, read_lineage
from tiderl.runtime.run_log import RunLog

STEPS = _metrics()  # records of steps 0..5
B_STEPS = [replace(m, loss=9.0) for m in STEPS[2:4]]  # run B's records of steps 2 and 3

# Run A trains steps 0-3 (checkpoint 2 after step 1, with that boundary's role change and the
# operator's reply after it), drops g6 and is stopped; the resume goes on from checkpoint 2
# (metrics.jsonl then held A's 4 records); run B trains steps 2 and 3 again, drops g7 and ends.
EVENTS = [
    {"time_s": 0.0, "kind": "launch"},
    {"time_s": 10.0, "kind": "trained", "step": 0, "attempt": 0, "groups": ["g0", "g1"]},
    {"time_s": 20.0, "kind": "trained", "step": 1, "attempt": 0, "groups": ["g2", "g3"]},
    {"time_s": 20.0, "kind": "role_change", "rank": 1, "src": "rollout", "dst": "actor",
     "step": 2, "version": 2},
    {"time_s": 20.001, "kind": "rebalance_applied", "version": 2},
    {"time_s": 20.001, "kind": "checkpoint", "version": 2, "folder": "step-00000002"},
    {"time_s": 25.0, "kind": "dropped_group", "group": "g6", "reason": "stale"},  # A's: cut
    {"time_s": 30.0, "kind": "trained", "step": 2, "attempt": 0, "groups": ["g4", "g5"]},
    {"time_s": 40.0, "kind": "trained", "step": 3, "attempt": 0, "groups": ["g6", "g7"]},
    {"time_s": 41.0, "kind": "stop", "reason": "stopped", "state": "stopped"},
    {"time_s": 20.0, "kind": "resume", "version": 2, "elapsed_s": 20.0, "metrics_lines": 4,
     "ready": ["g4"], "rerun": ["g5", "g6", "g7"]},
    {"time_s": 29.0, "kind": "trained", "step": 2, "attempt": 0, "groups": ["g4", "g5"]},
    {"time_s": 33.0, "kind": "dropped_group", "group": "g7", "reason": "a task produced no turn"},
    {"time_s": 39.0, "kind": "trained", "step": 3, "attempt": 0, "groups": ["g6", "g8"]},
    {"time_s": 40.0, "kind": "stop", "reason": "done", "state": "ok",
     "groups": {"fed": 10, "trained": 8, "dropped": 1, "buffered": 0, "rolling_out": 1}},
]
A_DISCARDED = EVENTS[6:10]


@pytest.fixture
def resumed(tmp_path: Path) -> Path:
    """The run folder: A's records of steps 0-3, then B's of steps 2 and 3."""
    _write_jsonl(tmp_path / "metrics.jsonl", [m.to_dict() for m in STEPS[:4] + B_STEPS])
    _write_jsonl(tmp_path / "events.jsonl", EVENTS)
    return tmp_path


def test_a_resume_cuts_what_the_run_before_did_after_its_checkpoint(resumed: Path):
    lineage = read_lineage(resumed)
    assert [m.step for m in lineage.metrics] == [0, 1, 2, 3]
    assert [m.loss for m in lineage.metrics] == [1.0, 0.5, 9.0, 9.0]  # steps 2 and 3: B's
    assert lineage.events == [e for e in EVENTS if e not in A_DISCARDED]  # the boundary's kept
    assert (lineage.num_discarded_records, lineage.num_discarded_events) == (2, 4)


def test_the_records_cut_are_those_written_before_the_resume():
    """B's record of step 2 is kept although A's of step 3 comes before it in the file: the
    resume event's metrics_lines says where B's begin."""
    records = STEPS[:4] + B_STEPS[:1]
    assert [(m.step, m.loss) for m in live_lineage(records, EVENTS).metrics] == [
        (0, 1.0), (1, 0.5), (2, 9.0)]
    # resumed and killed before B recorded a step: none of A's steps >= 2 is live
    assert [m.step for m in live_lineage(STEPS[:4], EVENTS[:11]).metrics] == [0, 1]


def test_a_lineage_discarded_inside_another_goes_with_it():
    """B resumed from checkpoint 2, trained step 2 and was killed before its next checkpoint;
    C resumed from checkpoint 2 again: B's record, its events and its resume are cut too."""
    b = [EVENTS[10], {"time_s": 29.0, "kind": "trained", "step": 2, "groups": ["g4", "g5"]}]
    c = [{**EVENTS[10], "metrics_lines": 5}, *EVENTS[11:]]
    lineage = live_lineage(STEPS[:4] + STEPS[2:3] + STEPS[2:4], EVENTS[:10] + b + c)
    assert [m.step for m in lineage.metrics] == [0, 1, 2, 3]
    assert lineage.num_discarded_records == 3
    assert [e["kind"] for e in lineage.events].count("resume") == 1
    assert lineage.events[6]["metrics_lines"] == 5  # C's resume right after the checkpoint


def test_without_its_checkpoint_event_a_resume_cuts_the_events_after_the_checkpoint_time():
    """The coordinator died between writing the checkpoint and its event: the resume's
    elapsed_s is the cut."""
    resume = {**EVENTS[10], "elapsed_s": 20.001}
    events = [*EVENTS[:5], *A_DISCARDED, resume, *EVENTS[11:]]  # no checkpoint event
    assert live_lineage([], events).events == [*EVENTS[:5], resume, *EVENTS[11:]]


def test_group_fates_of_the_live_lineage_each_trained_once_dropped_or_left_over(resumed):
    fates = group_fates(resumed)
    assert {g: f.steps for g, f in fates.groups.items() if f.fate is Fate.TRAINED} == {
        "g0": [0], "g1": [0], "g2": [1], "g3": [1], "g4": [2], "g5": [2], "g6": [3], "g8": [3]}
    assert fates.of(Fate.DROPPED) == ["g7"] and fates.groups["g7"].dropped == [
        "a task produced no turn"]
    assert fates.of(Fate.LEFT_OVER) == ["g9"]  # fed, still rolling out at the end
    assert fates.trained_twice == {}
    assert fates.problems() == []


def test_group_fates_of_the_raw_files_flag_each_group_trained_twice(resumed):
    fates = fates_of(read_jsonl(resumed / "events.jsonl"))
    assert fates.trained_twice == {"g4": [2, 2], "g5": [2, 2], "g6": [3, 3]}
    assert fates.problems() == [
        "g4 trained in steps [2, 2]", "g5 trained in steps [2, 2]", "g6 trained in steps [3, 3]",
        "g6 trained in step 3 and dropped (stale)", "g7 trained in step 3 and dropped "
        "(a task produced no turn)", "9 groups trained in the events, the stop event counts 8",
        "0 groups dropped in the events, the stop event counts 1"]


def test_a_group_never_fed_and_counts_that_disagree_with_the_stop_event_are_problems():
    extra = {"time_s": 39.5, "kind": "trained", "step": 4, "attempt": 0, "groups": ["g12"]}
    problems = fates_of(live_lineage([], [*EVENTS[:-1], extra, EVENTS[-1]]).events).problems()
    assert problems == ["g12 is in the events, not among the 10 groups fed",
                        "9 groups trained in the events, the stop event counts 8"]


def test_the_last_stop_is_the_live_lineages():
    """A stopped, then B resumed and was killed: no stop is live (the job crashed), though
    the last stop in the file is A's."""
    text = "".join(json.dumps(e) + "\n" for e in EVENTS[:11])
    assert last_stop_in(text) == {}
    assert last_stop_in(text + json.dumps(EVENTS[-1]) + "\n")["reason"] == "done"


def test_a_line_being_written_is_not_read_yet_and_a_new_run_log_drops_a_cut_short_one(
        resumed: Path):
    metrics = resumed / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 4, "ti')  # a write under way, or cut short by a kill
    assert [m.step for m in read_lineage(resumed).metrics] == [0, 1, 2, 3]
    run_log = RunLog(resumed, clock=lambda: 0.0)
    run_log.close()
    assert metrics.read_text() == whole
    assert run_log.num_prior_records == count_rows(metrics) == 6
