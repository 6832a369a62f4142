"""Profiles: typed loading, one-line errors naming the full key path, typed --set overrides."""

import textwrap

import pytest

from tiderl.core.config import ConfigError
from tiderl.core.ctb import CTBConfig
from tiderl.engine.config import EngineConfig
from tiderl.profile import (
    Profile,
    ProfileError,
    build_profile,
    load_profile,
    profile_to_dict,
    resolve_profile_path,
)
from tiderl.profile.sections import RuntimeConfig


def write(tmp_path, text, name="x.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(fn, *args):
    with pytest.raises(ProfileError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_local_profile_resolves_by_name():
    profile = load_profile("local")
    assert resolve_profile_path("local").name == "local.yaml"
    assert profile.engine.backend == "embedded"
    assert profile.model.size == "tiny"
    assert profile.runtime.device == "cpu"
    assert profile.env.step_latency.kind == "lognormal"
    assert (profile.job.batch_min_groups, profile.job.batch_groups, profile.job.steps) == (2, 4, 40)
    # keys the file leaves out keep their defaults
    assert profile.ctb.weights == CTBConfig().weights
    assert profile.engine.max_num_batched_tokens == EngineConfig().max_num_batched_tokens


def test_empty_file_gives_defaults(tmp_path):
    assert load_profile(write(tmp_path, "")) == Profile()


def test_wrong_type_names_file_and_full_key(tmp_path):
    path = write(tmp_path, """
        ctb:
          weights:
            eval: high
    """)
    assert error_of(load_profile, path) == f"{path}: ctb.weights.eval: expected float, got 'high'"


def test_unknown_key_is_named(tmp_path):
    path = write(tmp_path, "engine:\n  kv_cache_tokenz: 5\n")
    message = error_of(load_profile, path)
    assert message.startswith(f"{path}: engine.kv_cache_tokenz: unknown key (known: backend, ")


def test_unknown_section_is_named(tmp_path):
    path = write(tmp_path, "trainerr: {}\n")
    assert error_of(load_profile, path).startswith(f"{path}: trainerr: unknown key")


def test_impossible_values_name_the_key(tmp_path):
    path = write(tmp_path, "ctb:\n  budget_fraction: -0.5\n")
    assert error_of(load_profile, path).startswith(f"{path}: ctb.budget_fraction: ")
    path = write(tmp_path, "job:\n  batch_min_groups: 8\n  batch_groups: 4\n", "y.yaml")
    assert error_of(load_profile, path) == (
        f"{path}: job.batch_min_groups: expected <= batch_groups (4), got 8")
    path = write(tmp_path, "env:\n  step_latency: {kind: gaussian}\n", "z.yaml")
    message = error_of(load_profile, path)
    assert message.startswith(f"{path}: env.step_latency.kind: expected one of")


def test_old_keys_are_read_as_the_keys_they_moved_to(tmp_path):
    """The job's shape moved out of runtime, sim and ers; a file or --set that still names the
    old keys means the new ones (batch bounds in samples become whole groups)."""
    path = write(tmp_path, "runtime: {steps: 3, group_size: 4}\nsim: {eval_group_size: 2}\n"
                           "ers: {batch_min: 4, batch_ideal: 12}\n")
    job = load_profile(path).job
    assert (job.steps, job.group_size, job.eval_group_size) == (3, 4, 2)
    assert (job.batch_min_groups, job.batch_groups) == (1, 3)
    job = load_profile("local", ["runtime.steps=2", "job.group_size=4", "ers.batch_ideal=16"]).job
    assert (job.steps, job.group_size, job.batch_groups) == (2, 4, 4)
    # the names that said "mode" for a system and for RA2P's placement
    renamed = load_profile("local", ["runtime.mode=async", "ra2p.mode=decoupled"])
    assert (renamed.runtime.system, renamed.ra2p.placement) == ("async", "decoupled")


def test_an_old_key_beside_its_new_one_or_a_partial_group_is_refused(tmp_path):
    path = write(tmp_path, "runtime: {steps: 3}\njob: {steps: 4}\n")
    assert error_of(load_profile, path) == (
        f"{path}: runtime.steps: is the old name of job.steps, which is set too: keep one")
    path = write(tmp_path, "job: {group_size: 8}\ners: {batch_min: 12, batch_ideal: 32}\n",
                 "y.yaml")
    assert error_of(load_profile, path) == (
        f"{path}: ers.batch_min: expected a multiple of job.group_size (8), got 12")


@pytest.mark.parametrize(("overrides", "message"), [
    (["engine.backend=http", "engine.urls=[http://a:1]"],
     "engine.urls: expected one server URL per rank (runtime.num_ranks 4), got 1"),
    (["engine.urls=[http://a:1]"],
     "engine.urls: server URLs need a server backend (http, vllm, sglang), not 'embedded'"),
    (["engine.backend=vllm"], "model.path: engine.backend vllm serves an HF folder: set "
                              "model.path (tiderl model init makes one)"),
    (["engine.backend=sglang", "model.path=/m"],
     "runtime.device: engine.backend sglang starts its servers on GPUs: set "
     "runtime.device=cuda (or attach running servers with engine.urls)"),
    (["engine.host_kv_gib=8"], "engine.host_kv_gib: KV offload to host is set for vllm "
                               "servers only, not 'embedded' (SGLang's hierarchical cache: "
                               "engine.server_args)"),
    (["engine.gpu_memory_utilization=1.0"],
     "engine.gpu_memory_utilization: expected a fraction in (0, 1), got 1.0"),
    (["engine.kv_on_update=drop"], "engine.kv_on_update: expected one of flush, keep, "
                                   "got 'drop'"),
])
def test_engine_server_settings_are_checked_against_the_job(overrides, message):
    assert error_of(load_profile, "local", overrides) == f"--set: {message}"


def test_bool_is_not_an_int_and_lists_are_typed(tmp_path):
    path = write(tmp_path, "runtime:\n  num_ranks: true\n")
    assert error_of(load_profile, path) == f"{path}: runtime.num_ranks: expected int, got True"
    path = write(tmp_path, "env:\n  envs: [guess, 3]\n", "y.yaml")
    assert error_of(load_profile, path) == f"{path}: env.envs[1]: expected str, got 3"


def test_invalid_yaml_is_one_line_with_its_line(tmp_path):
    path = write(tmp_path, "ctb:\n  weights: [1, 2\nengine: {}\n")
    message = error_of(load_profile, path)
    assert message.startswith(f"{path}: invalid YAML at line ")


def test_overrides_are_typed():
    profile = load_profile("local", [
        "ctb.weights.eval=1000",
        "engine.kv_cache_tokens=4096",
        "ers.enabled=false",
        "env.url=8080",  # a str field keeps the text as given
        "env.envs=[guess, shop]",
    ])
    assert profile.ctb.weights.eval == 1000.0 and isinstance(profile.ctb.weights.eval, float)
    assert profile.engine.kv_cache_tokens == 4096
    assert profile.ers.enabled is False
    assert profile.env.url == "8080"
    assert profile.env.envs == ["guess", "shop"]


def test_override_errors_name_the_key():
    assert error_of(load_profile, "local", ["ctb.weights.eval=high"]) == (
        "--set: ctb.weights.eval: expected float, got 'high'")
    assert error_of(load_profile, "local", ["ctb.nope=1"]).startswith(
        "--set ctb.nope: unknown key 'ctb.nope' (known: weights, context_norm_tokens, ")
    assert error_of(load_profile, "local", ["ctb.budget_fraction"]).startswith(
        "--set ctb.budget_fraction: expected key=value")
    assert error_of(load_profile, "local", ["runtime.num_ranks.x=1"]) == (
        "--set runtime.num_ranks.x: unknown key 'runtime.num_ranks.x' (runtime.num_ranks is a "
        "value, not a section)")
    message = error_of(load_profile, "local", ["job.batch_min_groups=6"])
    assert message == "--set: job.batch_min_groups: expected <= batch_groups (4), got 6"


def test_missing_profile_is_one_line(tmp_path):
    assert error_of(load_profile, "nope").startswith("profile 'nope' not found")
    assert error_of(load_profile, str(tmp_path / "missing.yaml")).endswith("no such profile file")


def test_round_trip_through_plain_data():
    profile = load_profile("local")
    assert build_profile(profile_to_dict(profile)) == profile


def test_exponent_floats_without_a_dot_are_floats():
    """YAML 1.1 reads 1e-2 as a string; a float field takes it as the number it means."""
    profile = load_profile("local", ["trainer.lr=1e-2", "ctb.budget_fraction=5E-1"])
    assert profile.trainer.lr == 0.01 and profile.ctb.budget_fraction == 0.5
    with pytest.raises(ProfileError, match=r"trainer\.lr: expected float, got"):
        load_profile("local", ["trainer.lr=fast"])


MEGATRON = ["trainer.backend=megatron", "runtime.device=cuda", "ra2p.placement=colocated"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.backend=megatron"], "runtime.device: trainer.backend megatron runs on GPUs only "
                                   "(megatron-core's forward needs CUDA): set runtime.device=cuda"
                                   ", or use ddp or fsdp2"),
    (["trainer.tensor_parallel=2"], "trainer.tensor_parallel: expected 1 with backend ddp "
                                    "(tensor parallelism is the megatron backend's), got 2"),
    ([*MEGATRON, "trainer.tensor_parallel=2", "runtime.rollout_ranks=1"],
     "runtime.rollout_ranks: expected a multiple of trainer.tensor_parallel (2), got 1"),
    ([*MEGATRON[:2], "trainer.tensor_parallel=2"],
     "ra2p.placement: trainer.tensor_parallel > 1 runs the Ref beside its actors: set "
     "ra2p.placement=colocated (a Ref rank of its own would need a TP group)"),
])
def test_trainer_backend_settings_are_checked_against_the_job(overrides, message):
    assert error_of(load_profile, "local", overrides) == f"--set: {message}"


def test_a_tensor_parallel_megatron_job_on_whole_tp_blocks_is_accepted():
    profile = load_profile("local", [*MEGATRON, "trainer.tensor_parallel=2"])
    assert profile.trainer.tensor_parallel == 2


def test_runtime_config_built_in_code_says_why_one_rank_cannot_split():
    with pytest.raises(ConfigError) as error:
        RuntimeConfig(num_ranks=1)
    assert str(error.value) == ("num_ranks: expected at least 2 in system tiderl (a rollout rank "
                                "and a trainer rank; system sync runs on one), got 1")
    assert RuntimeConfig(num_ranks=1, rollout_ranks=1, system="sync").num_ranks == 1
