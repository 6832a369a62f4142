"""The run report on a full disk: a real filesystem that runs out of space (a small tmpfs,
mounted for the test), so that writing a PNG or report.md fails with ENOSPC as it does on a
full disk. Mounting needs root (or CAP_SYS_ADMIN); where it is refused the tests are skipped,
naming why. A PNG that fails otherwise (no tmpfs needed) is in tests/unit/test_runtime_report.py.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tmpfs import small_tmpfs
from tests.unit.test_runtime_report import EVENTS, _metrics
from tiderl.runtime.report import IMAGES, write_final_report, write_report


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs holding a run folder's metrics.jsonl and events.jsonl."""
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        for name, rows in (("metrics.jsonl", [m.to_dict() for m in _metrics()]),
                           ("events.jsonl", EVENTS)):
            (disk / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        yield disk


def fill(disk: Path, leave: int) -> None:
    """Take the disk's free space down to ``leave`` bytes (0: until a write fails with
    ENOSPC)."""
    stat = os.statvfs(disk)
    size = stat.f_bavail * stat.f_frsize - leave
    with (disk / "filler").open("wb") as out:
        try:
            while size > 0:
                size -= out.write(b"\0" * min(size, 4096))
                out.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC and not leave, exc


def test_a_full_disk_leaves_every_figure_out_and_the_report_says_which_and_why(small_disk):
    """Room for report.md (a few KB) and for no PNG (each more than 10 KB)."""
    fill(small_disk, leave=8192)
    text = write_report(small_disk, title="Demo run").read_text()
    assert "| trained tokens | 900 |" in text  # the report is whole but for its figures
    assert "Left out, as they could not be written: goodput_reward.png, roles.png, " \
        "readiness.png (No space left on device)." in text
    assert "![" not in text
    assert not [name for name in IMAGES if (small_disk / name).exists()]  # no cut-short PNG


def test_no_room_for_report_md_is_one_logged_line_naming_it(small_disk, caplog):
    fill(small_disk, leave=0)
    with caplog.at_level(logging.INFO, logger="tiderl.report"):
        assert write_final_report(small_disk, title="Demo run", plots=True) is None
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in records] == [
        f"no report: cannot write {small_disk / 'report.md'}: No space left on device"]
    assert records[0].exc_info is None  # one line, no traceback
    assert not (small_disk / "report.md").exists()
