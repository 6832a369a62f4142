"""A job whose every task fails (an environment that cannot start an episode) stops with the
reason, once 32 groups in a row failed, instead of feeding new groups for ever."""

from __future__ import annotations

from tiderl.launch.job import run_local
from tiderl.profile import load_profile
from tiderl.runtime.groups import MAX_FAILED_GROUPS_IN_A_ROW

BROKEN = "tests.integration.broken_env:OffScreen"


def test_a_job_whose_tasks_all_fail_stops_with_the_reason(tmp_path):
    profile = load_profile("local", [
        "runtime.num_ranks=2", "runtime.rollout_ranks=1", "job.group_size=2",
        "job.batch_min_groups=1", "job.batch_groups=2", f"env.envs=[{BROKEN}]", "env.tasks={}",
        "env.options={}", "job.steps=2", "runtime.heartbeat_s=0.5", "report.plots=false"])
    result = run_local(profile, run_root=tmp_path)
    log = (result.run_dir / "logs" / "coordinator.log").read_text()
    assert result.exit_code != 0, log[-2000:]
    assert f"{MAX_FAILED_GROUPS_IN_A_ROW} groups in a row had a task that failed" in log
    assert "the screen is off (on purpose)" in log
    assert not (result.run_dir / "metrics.jsonl").exists() or \
        not (result.run_dir / "metrics.jsonl").read_text().strip()  # nothing trained
