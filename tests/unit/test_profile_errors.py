"""Profile errors a new user meets first (issue 20): each one line that says what to change."""

import pytest

from tiderl.core.config import ConfigError
from tiderl.profile import (
    Profile,
    ProfileError,
    build_profile,
    load_profile,
    resolve_profile_path,
)


def error_of(*args) -> str:
    with pytest.raises(ProfileError) as info:
        load_profile(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("overrides", "message"), [
    (["runtime.num_ranks=1"],
     "runtime.num_ranks: 1 rank cannot split into rollout and trainer ranks: system tiderl needs "
     "at least 2, e.g. runtime.num_ranks=2 with runtime.rollout_ranks=1"),
    (["runtime.num_ranks=2"],  # the local profile's rollout_ranks is 2
     "runtime.rollout_ranks: 2 rollout ranks of runtime.num_ranks=2 leave no trainer rank: set "
     "runtime.rollout_ranks=1 (the other ranks train)"),
    (["runtime.rollout_ranks=0"],
     "runtime.rollout_ranks: a job needs at least 1 rollout rank, got 0: set "
     "runtime.rollout_ranks to 1..3 (the other ranks train)"),
    (["runtime.system=verl"],  # verl is sync: every rank rolls out and trains
     "runtime.rollout_ranks: system sync rolls out and trains on every rank: set "
     "runtime.rollout_ranks=4 (runtime.num_ranks), got 2"),
])
def test_a_rank_split_that_cannot_be_says_what_to_set(overrides, message):
    assert error_of("local", overrides) == f"--set: {message}"


def test_rank_splits_that_can_be_are_accepted():
    assert load_profile("local", ["runtime.num_ranks=2", "runtime.rollout_ranks=1"])
    sync = load_profile("local", ["runtime.system=sync", "runtime.num_ranks=1",
                                  "runtime.rollout_ranks=1"])
    assert sync.runtime.num_ranks == 1
    # a value of the wrong type is named as before, not explained as a split
    assert error_of("local", ["runtime.num_ranks=many"]) == (
        "--set: runtime.num_ranks: expected int, got 'many'")


def test_unknown_set_keys_list_the_known_ones_like_a_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ctb:\n  nope: 1\n")
    from_file = error_of(str(bad)).split("(known: ")[1]
    from_set = error_of("local", ["ctb.nope=1"]).split("(known: ")[1]
    assert from_set == from_file and from_set.startswith("weights, ")
    assert error_of("local", ["nope=1"]).endswith(
        "(known: job, model, engine, env, trainer, ctb, ra2p, ers, runtime, logging, report, "
        "sim)")


def test_a_binary_file_is_one_line_naming_it(tmp_path):
    binary = tmp_path / "model.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert error_of(str(binary)) == (
        f"{binary}: not a YAML text file (it holds bytes that are not text)")
    control = tmp_path / "control.yaml"
    control.write_bytes(b"ctb:\x00\x01\n")
    assert error_of(str(control)).startswith(f"{control}: not a YAML text file")


def test_a_folder_is_named_once(tmp_path, monkeypatch):
    message = error_of(str(tmp_path))
    assert message == (f"{tmp_path}: a folder, not a profile file (give a YAML file or a "
                       "profile name)")
    # a name that is also a folder here still finds the profile of that name
    (tmp_path / "local").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_profile_path("local").name == "local.yaml"


def test_a_missing_absolute_name_lists_each_place_once(tmp_path):
    message = error_of(str(tmp_path / "nope"))
    assert message == f"profile '{tmp_path / 'nope'}' not found (looked for {tmp_path}/nope.yaml)"


def test_a_profile_error_is_a_config_error():
    """The CLI turns both into one line with exit 2 without importing the profile code."""
    assert issubclass(ProfileError, ConfigError)
    assert str(ProfileError("x.yaml: bad")) == "x.yaml: bad"
    assert Profile()


BIG = "x" * 10_000_000
BIG_SHOWN = "… (10,000,000 characters)"  # what a 10 MB value shows as: its start, its length
ERROR_BOUND = 1000  # characters of one error line, whatever it quotes


def bounded(message: str, *names: str) -> str:
    """``message``, checked: one line under the bound, naming each of ``names``."""
    assert "\n" not in message and len(message) < ERROR_BOUND, message[:2000]
    for name in names:
        assert name in message, message
    return message


@pytest.mark.parametrize(("data", "key"), [
    ({"ctb": {"policy": BIG}}, "ctb.policy"),
    ({"runtime": {"system": BIG}}, "runtime.system"),
    ({"ers": {"planner": BIG}}, "ers.planner"),
    ({"engine": {"max_num_batched_tokens": BIG}}, "engine.max_num_batched_tokens"),
    ({"logging": {"backends": ["jsonl", BIG]}}, "logging.backends[1]"),
    ({"ctb": {BIG: 1}}, "ctb.xxxx"),  # an unknown key of 10 MB: its start
])
def test_a_10_mb_value_in_a_profile_is_an_error_under_the_bound_naming_the_key(data, key):
    with pytest.raises(ProfileError) as info:
        build_profile(data, source="big.yaml")
    bounded(str(info.value), f"big.yaml: {key}", BIG_SHOWN)


def test_a_10_mb_set_value_key_or_profile_name_is_an_error_under_the_bound():
    bounded(error_of("local", [f"ctb.policy={BIG}"]), "--set: ctb.policy: expected one of",
            BIG_SHOWN)
    bounded(error_of("local", [f"{BIG}=1"]), "--set xxxx", "unknown key 'xxxx", BIG_SHOWN)
    bounded(error_of("local", [f"ctb.nope={BIG}"]), "--set ctb.nope: unknown key 'ctb.nope'")
    bounded(error_of(BIG), "profile 'xxxx", BIG_SHOWN, "not found")
