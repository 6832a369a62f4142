"""`tiderl launch` and `tiderl status` as a new user first meets them (issue 20), the real
`tiderl` in a subprocess: status in a folder with no jobs."""

from __future__ import annotations

import json

from tests.integration.test_cli import tiderl


def test_status_in_a_folder_without_jobs_says_where_it_looked(tmp_path):
    proc = tiderl("status", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"no jobs in {tmp_path.resolve() / 'runs'}/ (runs/ of this folder; give --run-root DIR "
        "for jobs launched from another one)"]
    assert json.loads(tiderl("status", "--json", cwd=tmp_path).stdout) == []
