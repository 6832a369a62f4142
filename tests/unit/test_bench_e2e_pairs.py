"""`bench/e2e_pairs.py --variant NAME=OVERRIDES`: a list value's commas stay in its override."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from e2e_pairs import split_overrides


def test_overrides_split_at_commas_outside_brackets():
    assert split_overrides("ctb.release_waiting=true") == ["ctb.release_waiting=true"]
    assert split_overrides("a=1,env.envs=[guess,shop],b=[x,[y,z]]") == [
        "a=1", "env.envs=[guess,shop]", "b=[x,[y,z]]"]
    assert split_overrides("a=1,,b=2,") == ["a=1", "b=2"]
    assert split_overrides("env.options={a: 1, b: 2},c=3") == ["env.options={a: 1, b: 2}", "c=3"]
