"""Profile and --set errors through the real `tiderl`: one line, exit 2, saying what to change
(the messages themselves: tests/unit/test_profile_errors.py)."""

from __future__ import annotations

from tests.integration.test_cli import assert_one_line_error, tiderl


def test_profile_file_errors_are_one_line_naming_the_file_once(tmp_path):
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(bytes(range(128, 256)))
    line = assert_one_line_error(tiderl("launch", "--dry-run", "-p", str(binary)), 2)
    assert line == f"error: {binary}: not a YAML text file (it holds bytes that are not text)"
    line = assert_one_line_error(tiderl("launch", "--dry-run", "-p", str(tmp_path)), 2)
    assert line.count(str(tmp_path)) == 1 and "a folder, not a profile file" in line


def test_set_errors_say_what_to_change():
    line = assert_one_line_error(
        tiderl("launch", "--dry-run", "--set", "runtime.num_ranks=1"), 2)
    assert line == ("error: --set: runtime.num_ranks: 1 rank cannot split into rollout and "
                    "trainer ranks: system tiderl needs at least 2, e.g. runtime.num_ranks=2 with "
                    "runtime.rollout_ranks=1")
    line = assert_one_line_error(tiderl("launch", "--dry-run", "--set", "runtme.steps=3"), 2)
    assert line == ("error: --set runtme.steps: unknown key 'runtme' (known: job, model, engine, "
                    "env, trainer, ctb, ra2p, ers, runtime, logging, report, sim)")
