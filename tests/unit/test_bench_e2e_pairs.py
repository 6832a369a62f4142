"""`bench/e2e_pairs.py --variant NAME=OVERRIDES`: a list value's commas stay in its override."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).parents[2] / "bench" / "e2e_pairs.py"
_SPEC = importlib.util.spec_from_file_location("bench_e2e_pairs", _PATH)
e2e_pairs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(e2e_pairs)  # the script puts bench/ on sys.path for its own imports


def test_overrides_split_at_commas_outside_brackets():
    split_overrides = e2e_pairs.split_overrides
    assert split_overrides("ctb.release_waiting=true") == ["ctb.release_waiting=true"]
    assert split_overrides("a=1,env.envs=[guess,shop],b=[x,[y,z]]") == [
        "a=1", "env.envs=[guess,shop]", "b=[x,[y,z]]"]
    assert split_overrides("a=1,,b=2,") == ["a=1", "b=2"]
    assert split_overrides("env.options={a: 1, b: 2},c=3") == ["env.options={a: 1, b: 2}", "c=3"]
