"""`tiderl engine serve` and `tiderl env serve` with a port in use or out of range, or a bad
option: one line and exit 2, before anything heavy is imported or loaded."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.integration.test_cli import assert_one_line_error, tiderl


@pytest.mark.parametrize("group", ["engine", "env"])
def test_serve_on_a_port_in_use_fails_at_once_in_one_line(group):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # -X importtime: the modules it loaded, on stderr beside the error line
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tiderl.cli.main",
                               group, "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")]
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said == [f"error: tiderl {group} serve: port {port} on 127.0.0.1: in use (another "
                    "server? choose one with --port)"]
    assert not {"torch", "uvicorn", "fastapi"} & set(imported)  # nothing heavy started


@pytest.mark.parametrize("group", ["engine", "env"])
def test_serve_on_a_port_out_of_range_is_a_usage_error(group):
    line = assert_one_line_error(tiderl(group, "serve", "--port", "99999"), 2)
    assert "'--port'" in line and "65535" in line


def test_env_serve_names_the_option_of_a_bad_value():
    line = assert_one_line_error(tiderl("env", "serve", "--max-turns", "0"), 2)
    assert line == ("error: Invalid value for '--max-turns': Input should be greater than or "
                    "equal to 1 (see 'tiderl env serve --help')")
    line = assert_one_line_error(tiderl("env", "serve", "--idle-ttl", "0"), 2)
    assert line == "error: tiderl env serve: --idle-ttl: expected a positive number, got 0.0"
