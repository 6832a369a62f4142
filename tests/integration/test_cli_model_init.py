"""`tiderl model init` as a user runs it (a real process): every file it writes has the mode the
umask gives, and it writes into a folder with files in it only when given --force."""

from __future__ import annotations

import stat
import subprocess

import pytest

from tests.integration.serving import tiderl_command
from tests.integration.test_cli import assert_one_line_error

NAMES = ["config.json", "model.safetensors", "tokenizer.json"]


def model_init(*args: str, umask: int = 0o022) -> subprocess.CompletedProcess:
    return subprocess.run([*tiderl_command(), "model", "init", *args], capture_output=True,
                          text=True, timeout=120, umask=umask)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_gets_the_mode_of_the_umask(tmp_path, umask):
    proc = model_init("--out", str(tmp_path / "m"), umask=umask)
    assert proc.returncode == 0, proc.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").iterdir()}
    assert modes == dict.fromkeys(NAMES, 0o666 & ~umask)


def test_a_folder_with_files_is_refused_unless_force(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    line = assert_one_line_error(model_init("--out", str(tmp_path)), 2)
    assert str(tmp_path) in line and "not empty" in line and "--force" in line
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # nothing written

    proc = model_init("--out", str(tmp_path), "--force", "--json")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*NAMES, "notes.txt"])
    assert (tmp_path / "notes.txt").read_text() == "mine"
    again = model_init("--out", str(tmp_path), "--seed", "1")  # a model there is files too
    assert again.returncode == 2 and "not empty" in again.stderr


def test_a_file_as_out_is_refused(tmp_path):
    (tmp_path / "m").write_text("")
    line = assert_one_line_error(model_init("--out", str(tmp_path / "m"), "--force"), 2)
    assert "is a file" in line
