"""The real `tiderl` executable in a subprocess: help, dry run, one-line errors, exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

GROUPS = ["launch", "top", "status", "logs", "stop", "rebalance", "measure", "bench", "sim",
          "env", "engine", "model"]


def tiderl(*args, cwd=None):
    script = Path(sys.executable).with_name("tiderl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "tiderl.cli.main"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60, cwd=cwd)


def assert_one_line_error(proc, code):
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_help_lists_every_command_group():
    proc = tiderl("--help")
    assert proc.returncode == 0
    for group in GROUPS:
        assert f" {group} " in proc.stdout, group


def test_dry_run_prints_the_resolved_local_profile_and_plan():
    proc = tiderl("launch", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    for text in ("engine", "kv_cache_tokens", "8192", "ctb", "weights.eval", "plan", "rank3",
                 "[guess]"):  # values are data, never rich markup
        assert text in proc.stdout, text


def test_dry_run_json_with_overrides():
    proc = tiderl("launch", "--dry-run", "--json", "--set", "runtime.num_ranks=6",
                  "--set", "ctb.weights.context=0.5")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["profile"]["ctb"]["weights"]["context"] == 0.5
    ranks = [p for p in data["plan"] if p["kind"] == "rank"]
    assert [p["role"] for p in ranks] == ["rollout", "rollout", "actor", "actor", "actor", "actor"]
    assert {p["kind"] for p in data["plan"]} == {"env", "coordinator", "rank"}


def test_dry_run_shows_what_the_system_runs_where_it_differs_from_the_profile():
    proc = tiderl("launch", "--dry-run", "--json", "--set", "runtime.system=async")
    assert proc.returncode == 0, proc.stderr
    effective = json.loads(proc.stdout)["effective"]
    assert effective["system"] == "async" and not effective["has_ers"]
    assert effective["changes"] == {"ctb.policy": ["ctb", "request"],
                                    "ra2p.placement": ["auto", "colocated"]}
    text = tiderl("launch", "--dry-run", "--set", "runtime.system=async").stdout
    assert "effective: what system async runs" in text and "request (profile: ctb)" in text
    sim = json.loads(tiderl("sim", "sim/cluster32", "--dry-run", "--json").stdout)
    assert sim["job"]["batch_groups"] == 32 and set(sim["systems"]) == {"sync", "async",
                                                                        "stream", "tiderl"}
    assert sim["systems"]["stream"]["changes"]["ra2p.tokens_per_rank"] == [8192, 2048]
    assert sim["systems"]["tiderl"]["has_ers"] and not sim["systems"]["async"]["has_ers"]


def test_bad_key_is_one_line_with_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ctb:\n  weights:\n    eval: high\n")
    line = assert_one_line_error(tiderl("launch", "--dry-run", "--profile", str(bad)), 2)
    assert line == f"error: {bad}: ctb.weights.eval: expected float, got 'high'"
    line = assert_one_line_error(tiderl("launch", "--dry-run", "--set", "ctb.nope=1"), 2)
    assert line.startswith("error: --set ctb.nope: unknown key 'ctb.nope' (known: weights, ")


def test_debug_shows_the_traceback(tmp_path):
    proc = tiderl("--debug", "launch", "--dry-run", "--set", "ctb.nope=1")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr


def test_bad_usage_is_one_line_with_exit_2():
    line = assert_one_line_error(tiderl("launch", "--no-such-flag"), 2)
    assert "--no-such-flag" in line
    assert_one_line_error(tiderl("no-such-command"), 2)
    line = assert_one_line_error(tiderl("bench", "e2e", "--workload", "video"), 2)
    assert "--workload 'video': expected one of text, gui" in line


@pytest.mark.parametrize(("args", "text"), [
    (["top", "j1"], "no job 'j1'"), (["status", "j1"], "no job 'j1'"),
    (["logs", "j1"], "no job 'j1'"), (["stop", "j1"], "no job 'j1'"),
    (["rebalance", "j1", "--rollout", "2", "--trainer", "2"], "no job 'j1'"),
    (["measure", "kv", "--engine", "http://127.0.0.1:1"], "cannot read http://127.0.0.1:1"),
    (["measure", "readiness", "--job", "j1"], "no job 'j1'"),
    (["profile", "readiness", "--job", "j1"], "no job 'j1'"),  # measure's old name
])
def test_job_commands_on_a_missing_job_or_server_exit_1_with_one_line(args, text, tmp_path):
    line = assert_one_line_error(tiderl(*args, cwd=tmp_path), 1)
    assert text in line


def test_logs_follow_of_an_ended_job_prints_every_line_and_ends(tmp_path):
    """-f on a job whose processes have all ended: one read of the whole log (its last line
    too, which its process left without a newline), then exit 0."""
    from tiderl.launch.local import JobRecord, ProcessRecord

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    run_dir = tmp_path / "runs" / "j1"
    (run_dir / "logs").mkdir(parents=True)
    log = run_dir / "logs" / "rank0.log"
    log.write_text("rank 0 up\nrank 0: last words")
    JobRecord("j1", str(run_dir), 0.0, [ProcessRecord("rank0", "rank", int(ended.stdout),
                                                     str(log), [], rank=0)]).save()
    proc = tiderl("logs", "j1", "-f", "--run-root", str(tmp_path / "runs"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["rank 0 up", "rank 0: last words"]


def test_a_run_root_that_cannot_hold_a_run_folder_is_one_line_with_exit_2(tmp_path):
    root = tmp_path / "runs"
    root.write_text("a file where the run root should be")
    line = assert_one_line_error(tiderl("launch", "--run-root", str(root / "sub")), 2)
    assert line == (f"error: tiderl launch: cannot make a run folder in {root / 'sub'}: "
                    "Not a directory")
    assert root.read_text() == "a file where the run root should be"


def test_a_huge_value_is_one_bounded_line_naming_its_key(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("ctb:\n  policy: " + "x" * 1_000_000 + "\n")
    line = assert_one_line_error(tiderl("launch", "--dry-run", "--profile", str(big)), 2)
    assert line.startswith(f"error: {big}: ctb.policy: expected one of ")
    assert len(line) < 1000 and line.endswith("… (1,000,000 characters)")
    path = "x" * 100_000  # an argument holds at most 128 KiB
    line = assert_one_line_error(tiderl("launch", "--dry-run", "--set", f"model.path={path}"), 2)
    assert line.startswith("error: tiderl launch: model.path xxx") and len(line) < 1000
    assert line.endswith("… (100,000 characters): File name too long")
    line = assert_one_line_error(tiderl("status", path, cwd=tmp_path), 1)
    assert line.startswith("error: tiderl status: no job 'xxx") and len(line) < 1000


def test_the_error_printer_bounds_any_line(capsys):
    from tiderl.cli.output import Output
    from tiderl.core.quote import LINE_LIMIT

    Output.error("OSError: " + "y" * 10_000_000)
    line = capsys.readouterr().err
    assert line.startswith("error: OSError: yyy") and line.endswith(" characters)\n")
    assert len(line) == len("error: ") + LINE_LIMIT + 1


HUGE = "99999999999999999999999"


@pytest.mark.parametrize(("args", "option", "why"), [
    (["rebalance", "j1", "--rollout", HUGE, "--trainer", "1"], "--rollout",
     "less than or equal to 2147483647"),
    (["rebalance", "j1", "--rollout", "1", "--trainer", "-2"], "--trainer",
     "greater than or equal to 0"),
    (["rebalance", "j1", "--rollout", "two", "--trainer", "1"], "--rollout", "valid integer"),
    (["rebalance", "j1", "--rollout", "1", "--trainer", "1", "--timeout", "nan"], "--timeout",
     "less than or equal to 31536000"),
    (["stop", "j1", "--grace", "1e400"], "--grace", "less than or equal to 31536000"),
    (["logs", "j1", "--rank", "-1"], "--rank", "greater than or equal to 0"),
    (["top", "j1", "--once", "--timeout", "soon"], "--timeout", "valid number"),
    (["env", "serve", "--max-turns", HUGE], "--max-turns", "less than or equal to 2147483647"),
    (["env", "serve", "--port", "-80"], "--port", "greater than or equal to 1"),
    (["model", "init", "--out", "m", "--seed", HUGE], "--seed",
     "less than or equal to 4294967295"),
    (["bench", "e2e", "--steps", "0"], "--steps", "greater than or equal to 1"),
    (["measure", "kv", "--job", "j1", "--interval", "-inf"], "--interval",
     "greater than or equal to 0"),
])
def test_a_number_out_of_bounds_is_one_line_naming_the_option_exit_2(args, option, why,
                                                                     tmp_path):
    line = assert_one_line_error(tiderl(*args, cwd=tmp_path), 2)
    assert line.startswith(f"error: Invalid value for '{option}': ") and why in line
    assert list(tmp_path.iterdir()) == []  # nothing made: the command never ran


def test_a_profile_int_past_what_the_bus_carries_is_one_line_exit_2():
    line = assert_one_line_error(tiderl("launch", "--dry-run", "--set", f"job.steps={HUGE}"), 2)
    assert line == ("error: --set: job.steps: expected an int from -9223372036854775808 to "
                    f"9223372036854775807 (what job.json and the bus carry), got {HUGE}")


def test_version():
    proc = tiderl("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("tiderl ")


def test_a_dry_run_on_a_one_gpu_node_shows_every_rank_sharing_it(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("nodes:\n  - {name: ws, host: 127.0.0.1, devices: 1}\n")
    proc = tiderl("launch", "--dry-run", "--json", "--nodes", str(hosts),
                  "--set", "runtime.device=cuda")
    assert proc.returncode == 0, proc.stderr
    ranks = [p for p in json.loads(proc.stdout)["plan"] if p["kind"] == "rank"]
    assert [(p["host"], p["device"]) for p in ranks] == [("ws", "cuda:0")] * 4
    for p in ranks:
        assert p["command"][-4:] == ["--dist-backend", "gloo", "--memory-fraction", "0.25"]
    refused = tiderl("launch", "--dry-run", "--nodes", str(hosts), "--set", "runtime.device=cuda",
                     "--set", "trainer.backend=fsdp2")
    line = assert_one_line_error(refused, 2)
    assert line.startswith("error: trainer.backend fsdp2: 4 ranks share a device")
