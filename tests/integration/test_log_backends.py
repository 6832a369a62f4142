"""logging.backends: the coordinator's RunLog writes each step's record to metrics.jsonl, to
TensorBoard event files and to an offline wandb run, all in the run folder; each is read back
with the tool's own reader. A backend that is listed but not installed stops `tiderl launch` in
one line before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_cli import assert_one_line_error
from tests.integration.tracking import (
    as_float32,
    offline_wandb,
    tensorboard_scalars,
    wandb_history,
)
from tiderl.core.records import StepRecord
from tiderl.core.step_control import StepController
from tiderl.core.system import StepMode
from tiderl.launch.plan import profile_roles
from tiderl.profile import ProfileError, load_profile, profile_to_dict
from tiderl.runtime.groups import Dataset
from tiderl.runtime.log_backends import TensorBoardWriter, open_writers
from tiderl.runtime.report import write_report
from tiderl.runtime.run_log import RunLog
from tiderl.runtime.step_config import profile_step_config

ROLES = ("rollout", "rollout", "actor", "actor")


def _record(step: int, loss: float | None, kv: float | None) -> StepRecord:
    return StepRecord(
        step=step, start_s=10.0 * step, end_s=10.0 * step + 8.0, trained_tokens=100 + step,
        trained_tokens_total=100 * (step + 1), trained_samples=16, generated_tokens_total=300,
        discarded_tokens_total=0, ras=step, tprm_s=0.25 if step else None, rwt_s=0.5,
        twt_s=1.5, step_mode=StepMode.COLOCATED, roles=ROLES, num_rollout=2, num_trainer=2,
        num_micro_batches=3, kv_hit_rate=kv, staleness_max=step % 2, reward_mean=0.1 * step,
        solved_frac=0.0, eval_reward=None, loss=loss, grad_norm=0.3, batch_size=16,
        ers_reason="phase_end")


RECORDS = [_record(0, 1.2345, None), _record(1, 0.9876, 0.5), _record(2, 0.75, 0.625)]


def test_each_step_record_reaches_tensorboard_and_an_offline_wandb_run(tmp_path, monkeypatch):
    offline_wandb(monkeypatch, tmp_path / "home")
    run_dir = tmp_path / "job-1"
    run_dir.mkdir()
    profile = load_profile("local", ["logging.backends=[jsonl, tensorboard, wandb]"])
    assert profile.logging.backends == ["jsonl", "tensorboard", "wandb"]
    controller = StepController(profile_step_config(profile), profile_roles(profile),
                                Dataset(profile).group, now=0.0)
    run_log = RunLog(run_dir, lambda: 0.0,
                     writers=open_writers(profile.logging, run_dir, profile_to_dict(profile)))
    for record in RECORDS:
        run_log.record(record, controller, "")
    run_log.close()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    numeric = {k for row in rows for k, v in row.items()
               if isinstance(v, int | float) and not isinstance(v, bool)} - {"step"}
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert set(scalars) == numeric  # flags, strings and lists (is_trained, step_mode, roles)
    assert "is_trained" in rows[0] and "is_trained" not in scalars  # stay in metrics.jsonl
    assert "step_mode" not in scalars and "roles" not in scalars
    for tag in numeric:
        assert scalars[tag] == [(row["step"], as_float32(row[tag])) for row in rows
                                if row.get(tag) is not None], tag
    assert scalars["kv_hit_rate"] == [(1, 0.5), (2, 0.625)]  # null at step 0: no point
    assert scalars["goodput_tok_s"] == [(0, 12.5), (1, as_float32(11.11)),  # 200 / 18 s
                                        (2, as_float32(10.71))]

    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    (run_file,) = folder.glob("run-*.wandb")
    history = wandb_history(run_file)
    assert [step for step, _ in history] == [0, 1, 2]
    for (_, values), row in zip(history, rows, strict=True):
        assert values == {k: v for k, v in row.items()
                          if k in numeric and v is not None}

    text = write_report(run_dir).read_text()
    assert f"`tensorboard --logdir {(run_dir / 'tensorboard').resolve()}`" in text
    assert f"[{folder.name}](wandb/{folder.name}); `wandb sync {folder.resolve()}`" in text


def test_a_resumed_job_s_event_file_replaces_the_steps_it_trains_again(tmp_path):
    """Two coordinator starts on one logdir: the second (resumed from step 1's checkpoint)
    trains step 2 again; TensorBoard's reader keeps its points, not the first start's."""
    logdir = tmp_path / "tensorboard"
    first = TensorBoardWriter(logdir)
    for step, loss in ((0, 1.5), (1, 1.25), (2, 1.0)):
        first.write(step, {"loss": loss})
    first.close()
    resumed = TensorBoardWriter(logdir)
    for step, loss in ((2, 0.5), (3, 0.25)):
        resumed.write(step, {"loss": loss})
    resumed.close()
    assert len(list(logdir.iterdir())) == 2
    assert tensorboard_scalars(logdir)["loss"] == [(0, 1.5), (1, 1.25), (2, 0.5), (3, 0.25)]


def test_the_backends_list_is_checked_and_names_the_key():
    def error(value: str) -> str:
        with pytest.raises(ProfileError) as info:
            load_profile("local", [f"logging.backends={value}"])
        return str(info.value)

    assert error("[jsonl, mlflow]") == (
        "--set: logging.backends[1]: expected one of jsonl, tensorboard, wandb, got 'mlflow'")
    assert error("[tensorboard]").startswith(
        "--set: logging.backends: expected jsonl in the list (report.md, tiderl status and "
        "--resume read metrics.jsonl)")
    assert error("[jsonl, wandb, wandb]") == (
        "--set: logging.backends: expected each backend once, got ['jsonl', 'wandb', 'wandb']")
    assert error("tensorboard") == "--set: logging.backends: expected list, got 'tensorboard'"
    assert load_profile("local").logging.backends == ["jsonl"]


def test_a_listed_backend_that_is_not_installed_stops_the_launch_in_one_line(tmp_path):
    """A python that cannot import wandb (its sys.modules entry None, Python's way to block an
    import): `tiderl launch` says which extra to install, and no run folder is made."""
    code = ("import sys; sys.modules['wandb'] = None; from tiderl.cli.main import main; "
            "sys.exit(main())")
    proc = subprocess.run(
        [sys.executable, "-c", code, "launch", "--run-root", str(tmp_path),
         "--set", "logging.backends=[jsonl,tensorboard,wandb]", "--set", "job.steps=1"],
        capture_output=True, text=True, timeout=60)
    line = assert_one_line_error(proc, 2)
    assert line == ("error: tiderl launch: logging.backends: wandb is listed but not installed "
                    "(pip install 'tiderl[logging]')")
    assert list(tmp_path.iterdir()) == []
