"""Real jobs whose rollout runs on engine servers (``engine.backend: http``): the launcher starts
one ``tiderl engine serve`` per rank, each rank drives its own over HTTP (no mocks)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import httpx
import pytest

from tiderl.engine.prometheus import parse_prometheus
from tiderl.launch.job import run_local
from tiderl.launch.local import JobRecord, LaunchError, group_members, is_running
from tiderl.profile import load_profile
from tiderl.trainer.export import versions

SMALL = [
    "runtime.num_ranks=3", "runtime.rollout_ranks=1", "job.group_size=4",
    "job.batch_min_groups=1", "job.batch_groups=2", "env.max_turns=4", "engine.max_new_tokens=8",
    "engine.kv_cache_tokens=2048", "env.step_latency.median_s=0.02", "runtime.heartbeat_s=0.5",
    "report.plots=false", "engine.backend=http",  # last: SMALL[:-1] is on the embedded engine
]


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _all_gone(run_dir: Path) -> list[str]:
    state = JobRecord.load(run_dir)
    return [r.name for r in state.processes if is_running(r.pid) or group_members(r.pid)]


def test_a_job_on_http_engine_servers_trains_with_weights_by_disk(tmp_path):
    """3 steps of system tiderl, one rollout and two actor ranks, each with its own server. ERS's
    cold start wakes rank 2's server at launch (weights from disk) and puts it back to sleep
    after step 0; every new version reaches the rollout servers as an HF folder; CTB's pins
    reach rank 0's server (its pin counter, read while the job runs)."""
    profile = load_profile("local", [*SMALL, "job.steps=3", "job.batch_groups=1"])
    pins: list[float] = []
    outsiders: set[int] = set()  # what the job's servers answer a request without its token

    # one client for every snapshot: each new one loads the CA bundle (40 ms of CPU, 3 times a
    # snapshot, taken from the job's processes)
    http = httpx.Client(timeout=5)

    def read_pins(snap) -> None:  # rank 0's server, while the job runs
        ports = JobRecord.load(next(tmp_path.glob("*/job.json")).parent).info["ports"]
        with contextlib.suppress(httpx.HTTPError):
            page = http.get(f"http://127.0.0.1:{ports['engine0']}/metrics").text
            pins.append(parse_prometheus(page)["tiderl:pins"])
            for url in (f"http://127.0.0.1:{ports['engine0']}/tiderl/flush",
                        f"http://127.0.0.1:{ports['env']}/start"):
                outsiders.add(http.post(url, json={"env": "guess"}).status_code)

    with http:
        result = run_local(profile, run_root=tmp_path, on_snapshot=read_pins)
    assert result.exit_code == 0 and result.report is not None
    assert pins and max(pins) > 0  # CTB's pins went to the server's admin route, with the token
    assert outsiders == {401}  # the job's engine and environment servers need the job's tokens
    run_dir = result.run_dir
    metrics = _read(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # trained on tokens of the versions the servers loaded: with stale versions (a server that
    # never took an update) step 2's groups would all be dropped as older than the bound
    assert all(m["trained_samples"] >= 4 and m["reward_mean"] is not None for m in metrics)
    bound = profile.job.max_staleness + profile.job.carry_versions
    assert all(m["staleness_max"] <= bound for m in metrics)
    assert any(m["kv_hit_rate"] for m in metrics)  # later turns hit the server's prefix cache
    state = JobRecord.load(run_dir)
    assert [p.name for p in state.processes if p.kind == "engine"] == [
        "engine0", "engine1", "engine2"]
    events = _read(run_dir / "events.jsonl")
    moves = [(e["rank"], e["src"], e["dst"]) for e in events if e["kind"] == "role_change"]
    assert moves[:2] == [(2, "actor", "rollout"), (2, "rollout", "actor")]
    logs = run_dir / "logs"
    rank0, rank2 = (logs / "rank0.log").read_text(), (logs / "rank2.log").read_text()
    assert re.search(r"engine server http://127\.0\.0\.1:\d+ up \(serving\)", rank0)
    assert re.search(r"up \(asleep\)", rank2)
    assert re.search(r"awake, version 0 from .*/weights/v00000000", rank2)  # the cold start
    assert rank2.count(": asleep") == 2  # at start, and when it went back to the trainer
    for version in (1, 2, 3):
        assert re.search(rf": version {version} from .*/weights/v0000000{version}", rank0)
    assert versions(run_dir / "weights") == [2, 3]  # engine.keep_versions
    assert _all_gone(run_dir) == []


def test_ctb_pauses_tasks_on_engine_servers(tmp_path):
    """Two rollout ranks whose CTB budget is 5% of their servers' KV: CTB pauses tasks while
    the job runs, and every group is trained, dropped or accounted as still out (a server
    killed or stopped under a job: tests/chaos). CTB admits by headroom alone here: with its
    growth projection it would place one task per rank, which it never pauses."""
    profile = load_profile("local", [*SMALL, "job.steps=4", "runtime.rollout_ranks=2",
                                     "ers.enabled=false", "ctb.budget_fraction=0.05",
                                     "ctb.project_growth=false"])
    paused: list[float] = []
    result = run_local(profile, run_root=tmp_path,
                       on_snapshot=lambda snap: paused.append(snap.metrics.get("paused", 0)))
    assert result.exit_code == 0
    assert max(paused) > 0  # tasks were paused while the job ran
    metrics = _read(result.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(4))
    events = _read(result.run_dir / "events.jsonl")
    (stop,) = [e for e in events if e["kind"] == "stop"]
    groups = stop["groups"]  # none was lost: each trained, dropped or still out
    assert groups["fed"] == (groups["trained"] + groups["dropped"] + groups["buffered"]
                             + groups["rolling_out"])
    assert _all_gone(result.run_dir) == []


def _launch_error(profile, tmp_path: Path) -> str:
    """The one line a launch that fails says; nothing of the job is left running."""
    with pytest.raises(LaunchError) as info:
        run_local(profile, run_root=tmp_path, job_id="bad")
    assert _all_gone(tmp_path / "bad") == []
    return str(info.value)


def test_an_engine_server_that_cannot_start_stops_the_launch_in_one_line(tmp_path):
    profile = load_profile("local", [*SMALL, "job.steps=3",
                                     "engine.server_args=[--no-such-flag]"])
    message = _launch_error(profile, tmp_path)
    assert re.fullmatch(r"engine\d exited with code 2: .*No such option: --no-such-flag.* "
                        r"\(see .*/bad/logs/engine\d\.log\)", message), message


def test_a_rank_that_dies_before_the_job_is_up_stops_the_launch_in_one_line(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    # a Qwen2 config.json without its fields: passes the launcher's checks, fails in a rank
    (broken / "config.json").write_text('{"model_type": "qwen2"}')
    profile = load_profile("local", [*SMALL[:-1], "job.steps=3", f"model.path={broken}"])
    message = _launch_error(profile, tmp_path)
    assert re.fullmatch(r"rank\d exited with code 1: .*broken-model/config\.json: .* "
                        r"\(see .*/bad/logs/rank\d\.log\)", message), message


def test_what_the_launcher_can_check_here_fails_before_anything_starts(tmp_path):
    profile = load_profile("local", [f"model.path={tmp_path / 'none'}"])
    with pytest.raises(LaunchError, match=r"model\.path .*/none: no config\.json there"):
        run_local(profile, run_root=tmp_path, job_id="none")
    assert not (tmp_path / "none").exists()
    (tmp_path / "torn-model").mkdir()
    (tmp_path / "torn-model" / "config.json").write_text("{")  # no model_type to read
    profile = load_profile("local", [f"model.path={tmp_path / 'torn-model'}"])
    with pytest.raises(LaunchError, match=r"model\.path: .*/torn-model/config\.json: "):
        run_local(profile, run_root=tmp_path, job_id="torn")
    assert not (tmp_path / "torn").exists()
