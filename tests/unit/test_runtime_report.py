"""The run report on hand-written run folders: real files, real matplotlib (Agg)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiderl.core.records import StepRecord
from tiderl.core.system import StepMode
from tiderl.runtime.lineage import ReportError, read_jsonl, read_records
from tiderl.runtime.report import IMAGES, summarize, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOKENS = [100, 120, 140, 160, 180, 200]
TIMES = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
REWARDS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
EVALS = {2: 0.35, 5: 0.55}
MODES = ["colocated", "colocated", "decoupled", "decoupled", "decoupled", "decoupled"]
KV = [None, 0.5, 0.6, 0.7, 0.8, 0.9]
KEPT = [None, None, 1.0, 0.9, 0.8, 0.9]
TPRM = [None, None, 1.5, 1.2, 0.9, 0.8]
STALENESS = [0, 1, 1, 2, 3, 1]
# Rank 1 goes rollout -> actor at step 3, rank 0 rollout -> ref at step 5.
ROLES = [["rollout", "rollout", "actor", "actor"]] * 3 + [
    ["rollout", "actor", "actor", "actor"]] * 2 + [["ref", "actor", "actor", "actor"]]


def _metrics() -> list[StepRecord]:
    rows, total = [], 0
    for i in range(6):
        total += TOKENS[i]
        rows.append(StepRecord(
            step=i, start_s=TIMES[i] - 10.0, end_s=TIMES[i], trained_tokens=TOKENS[i],
            trained_tokens_total=total, trained_samples=4,
            generated_tokens_total=250 * (i + 1), discarded_tokens_total=10 * i, ras=i % 3,
            tprm_s=TPRM[i], rwt_s=1.0, twt_s=0.5, step_mode=StepMode(MODES[i]),
            roles=tuple(ROLES[i]), num_rollout=ROLES[i].count("rollout"),
            num_trainer=ROLES[i].count("actor"), num_micro_batches=2, kv_hit_rate=KV[i],
            staleness_max=STALENESS[i], reward_mean=REWARDS[i], solved_frac=0.0,
            eval_reward=EVALS.get(i), loss=1.0 / (i + 1), grad_norm=0.3, batch_size=4,
            ers_reason=None, kv_retention=KEPT[i]))
    return rows


EVENTS = [
    {"time_s": 0.0, "kind": "launch"},
    {"time_s": 31.0, "kind": "eval", "step": 2, "reward": 0.35},
    {"time_s": 32.5, "kind": "role_change", "rank": 1, "src": "rollout", "dst": "actor", "step": 3},
    {"time_s": 52.0, "kind": "role_change", "rank": 0, "src": "rollout", "dst": "ref", "step": 5},
    {"time_s": 61.0, "kind": "stop", "reason": "max_steps"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    _write_jsonl(tmp_path / "metrics.jsonl", [m.to_dict() for m in _metrics()])
    _write_jsonl(tmp_path / "events.jsonl", EVENTS)
    return tmp_path


def test_summarize_computes_the_table_numbers():
    s = summarize(_metrics())
    assert s["num_steps"] == 6
    assert s["wall_time_s"] == 60.0
    assert s["trained_tokens_total"] == sum(TOKENS) == 900
    assert s["goodput_end_tok_s"] == pytest.approx(900 / 60)
    last_half = [sum(TOKENS[: i + 1]) / TIMES[i] for i in (3, 4, 5)]
    assert s["goodput_last_half_mean_tok_s"] == pytest.approx(sum(last_half) / 3)
    assert (s["generated_tokens_total"], s["discarded_tokens_total"]) == (1500, 50)
    assert s["reward_first"] == 0.1
    assert s["reward_last3_mean"] == pytest.approx(0.5)
    assert (s["eval_reward_first"], s["eval_reward_last"]) == (0.35, 0.55)
    assert s["staleness_max"] == 3
    assert s["kv_hit_rate_mean"] == pytest.approx(0.7)
    assert s["kv_retention_mean"] == pytest.approx(0.9)
    assert (s["rwt_total_s"], s["twt_total_s"]) == (6.0, 3.0)
    assert s["modes"] == {"colocated": 2, "decoupled": 4}
    assert s["num_role_changes"] == 2


def test_report_has_summary_steps_role_changes_and_valid_images(run_dir: Path):
    path = write_report(run_dir, title="Demo run")
    assert path == run_dir / "report.md"
    text = path.read_text()
    assert text.startswith("# Demo run\n")
    assert "| trained tokens | 900 |" in text
    assert f"| goodput at end (tok/s) | {900 / 60:.1f} |" in text  # 15.0
    assert "| mean goodput, last half of steps (tok/s) | 14.0 |" in text  # (13 + 14 + 15) / 3
    assert "| generated tokens | 1500 |" in text
    assert "| reward: first step / mean of last 3 | 0.100 / 0.500 |" in text
    assert "| eval reward: first / last | 0.350 / 0.550 |" in text
    assert "| max staleness | 3 |" in text
    assert "| mean KV hit rate | 0.700 |" in text
    assert "| total RWT / TWT (s) | 6.00 / 3.00 |" in text
    assert "| modes (steps) | colocated: 2, decoupled: 4 |" in text
    assert "| role changes (rank-steps) | 2 |" in text
    assert "| 0 | 10.0 | colocated | R2 A2 | 0 | n/a | 10.0 | 0.100 | 1.0000 | 0 |" in text
    assert "| 5 | 60.0 | decoupled | F1 A3 | 2 | 0.80 | 15.0 | 0.600 | 0.1667 | 1 |" in text
    assert "- t=32.5 s, step 3: rank 1 rollout -> actor" in text
    assert "- t=52.0 s, step 5: rank 0 rollout -> ref" in text
    assert "Event counts: launch: 1, eval: 1, role_change: 2, stop: 1." in text
    for name in ("goodput_reward.png", "roles.png", "readiness.png"):
        assert f"]({name})" in text
        data = (run_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 10_000


def test_without_plots_the_report_has_its_tables_and_says_the_figures_were_not_drawn(
        run_dir: Path):
    text = write_report(run_dir, title="Demo run", plots=False).read_text()
    assert not list(run_dir.glob("*.png"))
    figures = "\n\n".join(f"![{name[:-4]}]({name})" for name in IMAGES)
    assert text == write_report(run_dir, title="Demo run").read_text().replace(
        figures, "Not drawn (the profile's report.plots is false).")
    assert "| trained tokens | 900 |" in text and "## Figures" in text


def test_missing_files_still_give_a_report_that_says_so(tmp_path: Path):
    text = write_report(tmp_path).read_text()
    assert text.startswith(f"# Run report: {tmp_path.name}\n")
    assert "No steps recorded" in text
    assert "No events recorded" in text
    assert "![" not in text
    assert not list(tmp_path.glob("*.png"))
    assert summarize([]) == {"num_steps": 0}


def test_empty_metrics_file_reads_as_no_steps(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text("\n")
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    assert "No steps recorded" in write_report(tmp_path).read_text()


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]"])
@pytest.mark.parametrize("name", ["metrics.jsonl", "events.jsonl"])
def test_malformed_line_names_file_and_line(run_dir: Path, name: str, bad: str):
    path = run_dir / name
    first = path.read_text().splitlines()[0]
    path.write_text(f"{first}\n\n{bad}\n")
    with pytest.raises(ReportError, match=rf"{name}:3: ") as info:
        write_report(run_dir)
    assert "\n" not in str(info.value)
    assert not (run_dir / "report.md").exists()


def test_a_line_that_is_not_a_step_record_is_one_line(run_dir: Path):
    path = run_dir / "metrics.jsonl"
    row = json.loads(path.read_text().splitlines()[0])
    del row["ras"]
    path.write_text(path.read_text() + json.dumps(row) + "\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl: record 7: a step record needs 'ras'"):
        read_records(path)
    assert [r.step for r in read_records(path.with_name("nothing.jsonl"))] == []


def test_a_line_reads_back_as_the_same_line():
    for record in _metrics():
        row = json.loads(json.dumps(record.to_dict()))  # floats rounded to 4 digits
        assert StepRecord.from_dict(row).to_dict() == row
        assert (row["version"], row["step_s"], row["step_mode"]) == (record.step + 1, 10.0,
                                                               record.step_mode.value)


def test_a_resumed_run_reports_each_step_once_and_its_faults(tmp_path: Path):
    metrics = _metrics()
    redone = metrics[:4] + metrics[2:]  # steps 2 and 3 ran, were lost to a kill, ran again
    _write_jsonl(tmp_path / "metrics.jsonl", [m.to_dict() for m in redone])
    # the checkpoint of version 2 was taken after step 1; the run went on to train step 2 (a
    # trained event and a dropped group the resume discards: not counted below)
    _write_jsonl(tmp_path / "events.jsonl", [
        {"time_s": 0.0, "kind": "launch"},
        {"time_s": 9.0, "kind": "rank_dead", "rank": 0, "role": "rollout",
         "why": "missed heartbeats"},
        {"time_s": 9.5, "kind": "dropped_group", "group": "g3", "reason": "stale"},
        {"time_s": 9.6, "kind": "rank_dead", "rank": 2, "role": "actor",
         "why": "its bus connection is gone"},
        {"time_s": 9.9, "kind": "trained", "step": 1, "attempt": 1, "groups": ["g2", "g3"]},
        {"time_s": 20.0, "kind": "checkpoint", "version": 2},
        {"time_s": 25.0, "kind": "dropped_group", "group": "g5", "reason": "stale"},
        {"time_s": 30.0, "kind": "trained", "step": 2, "attempt": 0, "groups": ["g4", "g6"]},
        {"time_s": 20.0, "kind": "resume", "version": 2, "elapsed_s": 20.0, "ready": ["g8"],
         "rerun": ["g9", "g10"], "metrics_lines": 4},
        {"time_s": 21.0, "kind": "message_dropped", "repeats": 4},
        {"time_s": 61.0, "kind": "stop", "reason": "done", "state": "ok"},
    ])
    text = write_report(tmp_path).read_text()
    steps = [line for line in text.splitlines() if line.startswith("| 2 | ")]
    assert len(steps) == 1  # the step table shows each step once
    assert "| trained tokens | 900 |" in text
    assert "Ended: ok: done." in text
    assert "| resumed from step 2 | 1 ready groups restored, 2 rolling out run again |" in text
    assert "| rank 0 (rollout) dead | missed heartbeats |" in text
    assert "| rank 2 (actor) dead | its bus connection is gone |" in text
    assert ("| step 1 trained at attempt 1 | a trainer rank died in the attempt before; the "
            "ranks left ran it again |") in text
    assert "| groups dropped: stale | 1 |" in text
    assert "| message dropped | 5 |" in text
    assert "Event counts: launch: 1, rank_dead: 2, dropped_group: 1, trained: 1, checkpoint: 1, " \
        "resume: 1, message_dropped: 1, stop: 1." in text
    assert "still in metrics.jsonl and events.jsonl): step records 2, events 2." in text


def test_a_figure_that_cannot_be_written_is_left_out_and_the_report_says_why(run_dir: Path):
    """A folder where roles.png should go: saving it fails (IsADirectoryError, an OSError as a
    full disk's is); the other figures and report.md are written (a full disk itself:
    tests/integration/test_report_full_disk.py)."""
    (run_dir / "roles.png").mkdir()
    text = write_report(run_dir).read_text()
    assert "![goodput_reward](goodput_reward.png)\n\n![readiness](readiness.png)\n" in text
    assert "](roles.png)" not in text
    assert "Left out, as they could not be written: roles.png (Is a directory)." in text
    for name in ("goodput_reward.png", "readiness.png"):
        assert (run_dir / name).read_bytes()[:8] == PNG_MAGIC
