"""`--variant NAME=OVERRIDES` of `bench/e2e_pairs.py` and `bench/ctb.py`: a list value's commas
stay in its override; a variant needs a new name."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[2] / "bench" / "e2e_pairs.py"
_SPEC = importlib.util.spec_from_file_location("bench_e2e_pairs", _PATH)
e2e_pairs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(e2e_pairs)  # the script puts bench/ on sys.path for its own imports
jobs = sys.modules["jobs"]  # bench/jobs.py, the benches' shared job runner


def test_overrides_split_at_commas_outside_brackets():
    split_overrides = jobs.split_overrides
    assert split_overrides("ctb.release_waiting=true") == ["ctb.release_waiting=true"]
    assert split_overrides("a=1,env.envs=[guess,shop],b=[x,[y,z]]") == [
        "a=1", "env.envs=[guess,shop]", "b=[x,[y,z]]"]
    assert split_overrides("a=1,,b=2,") == ["a=1", "b=2"]
    assert split_overrides("env.options={a: 1, b: 2},c=3") == ["env.options={a: 1, b: 2}", "c=3"]


def test_variants_need_a_new_name_and_overrides():
    def taken(name):
        return name == "tiderl"

    assert jobs.parse_variants(["a=x=1,y=[1,2]", "b=z=2"], taken) == {
        "a": ["x=1", "y=[1,2]"], "b": ["z=2"]}
    for specs in (["tiderl=x=1"], ["a=x=1", "a=y=2"], ["=x=1"], ["a="], ["a"]):
        with pytest.raises(ValueError, match="expected NAME=OVERRIDE"):
            jobs.parse_variants(specs, taken)
