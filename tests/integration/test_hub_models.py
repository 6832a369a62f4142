"""``model.path`` as a hub id, resolved by huggingface_hub against a hub cache laid out on disk
as it lays one out (blobs, snapshots linking to them, refs), with ``HF_HUB_OFFLINE=1``: no
network. The node command the launcher runs on each node, and a real job launched with an id."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.running_job import SMALL_JOB
from tests.integration.serving import tiderl_command
from tests.integration.test_cli import assert_one_line_error
from tiderl.models.hub import is_hub_id
from tiderl.models.random_init import write_random_checkpoint

REPO = "acme/tiny-qwen"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(hf_home: Path, repo_id: str, files: Path, commit: str, ref: str) -> Path:
    """``files`` as huggingface_hub caches a snapshot of ``repo_id`` at ``commit`` (its ``ref``
    pointing there); returns the snapshot folder."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(files.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """(the environment of a process that reads the cache offline, the snapshot folder)."""
    root = tmp_path_factory.mktemp("hub")
    write_random_checkpoint("tiny", root / "model", seed=3)
    snapshot = lay_out_cache(root / "hf", REPO, root / "model", COMMIT, "main")
    env = {**os.environ, "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return env, snapshot


def nodectl(env: dict[str, str], *args: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "tiderl.launch.nodectl", "model", *args],
                          capture_output=True, text=True, env=env, timeout=120)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_hub_id_resolves_to_its_cached_snapshot_and_commit(hub):
    env, snapshot = hub
    for revision in ((), ("--revision", "main"), ("--revision", COMMIT)):
        code, answer = nodectl(env, REPO, *revision)
        assert code == 0, answer
        assert answer == {"folder": str(snapshot), "repo_id": REPO, "revision": COMMIT}
    assert (Path(answer["folder"]) / "config.json").is_file()


@pytest.mark.parametrize("args, line", [
    ((REPO, "--revision", "v2"), f"model.path {REPO}@v2: not in the hub cache"),
    (("acme/tiny-qwne",), "model.path acme/tiny-qwne: not in the hub cache"),
])
def test_an_id_or_revision_not_cached_offline_is_one_line_naming_it(hub, args, line):
    env, _ = hub
    code, answer = nodectl(env, *args)
    assert code == 2
    assert answer["error"].startswith(line)
    assert answer["error"].endswith("and HF_HUB_OFFLINE is set")
    assert "\n" not in answer["error"]


def test_what_is_a_hub_id(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-7B-Instruct") and is_hub_id("gpt2")
    assert not is_hub_id(str(tmp_path))  # a folder that exists
    assert not is_hub_id("") and not is_hub_id("/models/qwen") and not is_hub_id("./qwen")
    assert not is_hub_id("a/b/c") and not is_hub_id("../qwen") and not is_hub_id("x" * 100_000)


def test_a_job_launched_with_a_hub_id_trains_on_the_snapshot_and_pins_its_commit(hub, tmp_path):
    env, snapshot = hub
    argv = [*tiderl_command(), "launch", "--json", "--run-root", str(tmp_path),
            "--set", f"model.path={REPO}", "--set", "job.steps=1"]
    for item in SMALL_JOB:
        argv += ["--set", item]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = Path(json.loads(proc.stdout)["run_dir"])
    profile = yaml.safe_load((run_dir / "profile.yaml").read_text())
    assert profile["model"]["path"] == str(snapshot)
    assert profile["model"]["revision"] == COMMIT
    info = json.loads((run_dir / "job.json").read_text())["info"]
    assert info["model"] == {"id": REPO, "revision": COMMIT, "folder": str(snapshot),
                             "nodes": ["localhost"]}
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1


def test_a_launch_with_an_id_not_cached_offline_is_refused_before_anything_starts(hub, tmp_path):
    env, _ = hub
    proc = subprocess.run([*tiderl_command(), "launch", "--run-root", str(tmp_path), "--set",
                           f"model.path={REPO}", "--set", "model.revision=v9"],
                          capture_output=True, text=True, env=env, timeout=120)
    line = assert_one_line_error(proc, 2)
    assert line.startswith(f"error: tiderl launch: model.path {REPO}@v9: not in the hub cache")
    assert list(tmp_path.iterdir()) == []  # no run folder
