"""A job killed after it trained past its checkpoint, then resumed: metrics.jsonl and
events.jsonl keep what the killed run did after the checkpoint (docs/runtime.md, "Faults and
resume"), the `checkpoint` and `resume` events mark it, and every reader of the two files skips
it (tiderl/runtime/lineage.py): the live lineage has each step once and each group trained once.
"""

from __future__ import annotations

import shutil

from tests.chaos.chaos_job import (
    chaos,
    checkpoint_of,
    cli_json,
    kill_job,
    launch,
    started,
    steps_done,
    wait_nothing_left,
)
from tiderl.launch.local import JobRecord
from tiderl.runtime.group_fates import Fate, fates_of, group_fates
from tiderl.runtime.lineage import read_jsonl, read_lineage, read_records

STEPS = 4  # a checkpoint every 2 steps (CHAOS_JOB): the run resumes from the one of step 2


def test_a_resume_leaves_the_discarded_lineage_in_the_files_and_every_reader_skips_it(
        tmp_path):
    with chaos(tmp_path) as jobs:
        job, _, run_dir = started(jobs, tmp_path, steps=STEPS)
        job.until(lambda: checkpoint_of(run_dir, 2) and steps_done(run_dir) >= 3,
                  "step 2 trained after the checkpoint of step 2")
        kill_job(JobRecord.load(run_dir))
        job.wait()
        wait_nothing_left(run_dir)
        # the killed run may have got further (its last checkpoint, even its end): without
        # them the resume goes on from step 2, and the steps it trained after it are discarded
        for folder in (run_dir / "checkpoints").glob("step-*"):
            if folder.name > "step-00000002":
                shutil.rmtree(folder)
        killed_records = len(read_records(run_dir / "metrics.jsonl"))
        resumed = launch(tmp_path, resume=run_dir.name)
        jobs.append(resumed)
        assert resumed.wait() == 0, resumed.output

        raw_events = read_jsonl(run_dir / "events.jsonl")
        (resume,) = [e for e in raw_events if e["kind"] == "resume"]
        assert (resume["version"], resume["metrics_lines"]) == (2, killed_records)
        before = raw_events[:raw_events.index(resume)]
        assert next(e["version"] for e in before if e["kind"] == "checkpoint") == 2
        # the raw files hold both runs' step 2: its record and trained event, before and after
        raw_steps = [r.step for r in read_records(run_dir / "metrics.jsonl")]
        assert raw_steps[:killed_records].count(2) == raw_steps[killed_records:].count(2) == 1
        assert 2 in [e["step"] for e in before if e["kind"] == "trained"]

        lineage = read_lineage(run_dir)
        assert [m.step for m in lineage.metrics] == list(range(STEPS))
        assert lineage.num_discarded_records == killed_records - 2
        trained = [e for e in lineage.events if e["kind"] == "trained"]
        assert [e["step"] for e in trained] == list(range(STEPS))
        fates = group_fates(run_dir)
        assert fates.problems() == [] and fates.trained_twice == {}
        assert len(fates.of(Fate.TRAINED)) == fates.counts["trained"] >= STEPS
        # read raw, the killed run's step 2 trained its groups once more: each is trained
        # twice, or trained and dropped, or counted trained by no stop event
        assert fates_of(raw_events).problems()

        # the readers: the report, tiderl status, tiderl measure readiness
        report = (run_dir / "report.md").read_text()
        for step in range(STEPS):
            assert sum(line.startswith(f"| {step} | ") for line in report.splitlines()) == 1
        assert f"step records {killed_records - 2}, events " in report
        assert cli_json(tmp_path, "status", run_dir.name)["steps"] == f"{STEPS}/{STEPS}"
        readiness = cli_json(tmp_path, "measure", "readiness", "--job", run_dir.name)
        assert [row["step"] for row in readiness["steps"]] == list(range(STEPS))
