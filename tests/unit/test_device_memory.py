"""The GPU-memory check of a CUDA job whose ranks share GPUs: parameters counted from the
folder's safetensors headers, each role's bytes, and the one line that refuses a job."""

import pytest

from tiderl.launch.device_memory import GIB, check_device_memory, num_parameters, rank_memory
from tiderl.models.random_init import init_model, write_random_checkpoint
from tiderl.profile import load_profile


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("small")
    write_random_checkpoint("small", out, seed=0)
    return str(out)


def test_parameters_are_counted_from_the_headers(folder):
    model = init_model("small", seed=0)
    assert num_parameters(folder) == sum(p.numel() for p in model.parameters())


def test_each_roles_bytes():
    config = {"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
              "hidden_size": 256}
    profile = load_profile("local", ["model.dtype=bfloat16", "engine.kv_cache_tokens=1000",
                                     "trainer.kl_beta=0.01"])
    memory = rank_memory(profile, 1_000_000, config)
    # engine: 2 MB of weights + 1000 tokens x 8 layers x 2 x 4 heads x 32 dims x 2 bytes
    assert memory.rollout == 2_000_000 + 1000 * 8 * 2 * 4 * 32 * 2
    assert memory.trainer == 4 * 2_000_000 + 2_000_000  # weights, grads, 2 moments; a Ref
    assert rank_memory(load_profile("local", ["trainer.kl_beta=0"]), 1000, config).trainer \
        == 4 * 4 * 1000


def test_ranks_that_cannot_fit_their_share_are_refused_in_one_line(folder):
    profile = load_profile("local", ["runtime.device=cuda", f"model.path={folder}"])
    need = rank_memory(profile, num_parameters(folder), {
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
        "hidden_size": 256}).most
    roomy = 4 * need + GIB  # four ranks on one GPU, each a quarter: fits
    assert check_device_memory(profile, [roomy], 1) is None
    tight = 4 * need - 4  # a quarter of it is just short
    line = check_device_memory(profile, [tight], 1)
    assert line.startswith("runtime.num_ranks 4: 4 ranks share each 0.6 GiB GPU, so a rank has ")
    assert "use fewer ranks, more GPUs or a smaller model" in line and "\n" not in line
    assert check_device_memory(profile, [tight] * 4, 4) is None  # one rank per GPU
    assert check_device_memory(profile, None, 1) is None  # no nvidia-smi: not checked
