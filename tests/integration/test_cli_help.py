"""`tiderl ... --help` as printed: paragraphs rewrapped to the terminal, boolean flags without a
value placeholder, and `tiderl --help` importing no heavy library (its start-up time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.serving import tiderl_command

WIDTH = 80
HELP_PAGES = [["launch"], ["logs"], ["stop"], ["bench", "e2e"], ["engine", "serve"]]


@pytest.mark.parametrize("page", HELP_PAGES, ids=" ".join)
def test_help_paragraphs_are_rewrapped_and_flags_take_no_value(page):
    proc = subprocess.run([*tiderl_command(), *page, "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": str(WIDTH)})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    description = text.split("\n\n", 1)[1].split("\nOptions:")[0].split("\nArguments:")[0]
    for paragraph in description.strip().split("\n\n"):
        lines = paragraph.splitlines()
        # every line but a paragraph's last is filled: none is broken where the source was
        assert all(len(line) > WIDTH - 20 for line in lines[:-1]), paragraph
    assert "<bool>" not in text
    assert all(len(line) <= WIDTH for line in text.splitlines()), text


def test_help_imports_no_heavy_library():
    code = ("import json, sys\n"
            "from tiderl.cli.main import main\n"
            "code = main(['--help'])\n"
            "print(json.dumps([code, sorted(sys.modules)]), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert " launch " in proc.stdout
    code, modules = json.loads(proc.stderr.splitlines()[-1])
    assert code == 0
    heavy = {"torch", "transformers", "numpy", "matplotlib", "zmq", "httpx", "fastapi",
             "uvicorn", "paramiko", "fabric"}
    assert heavy.isdisjoint(modules), sorted(heavy & set(modules))


def test_the_profile_default_launch_shows_is_the_one_it_loads():
    """cli/options.py writes the default out (importing it would load the profile code on
    --help)."""
    from tiderl.profile import DEFAULT_PROFILE

    proc = subprocess.run([*tiderl_command(), "launch", "--help"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert f"[default: {DEFAULT_PROFILE}]" in proc.stdout
