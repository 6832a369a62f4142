"""The megatron-core backend: import guard, config, exact weight conversion, and numerics.

Conversion and construction run on CPU when megatron-core is installed (``tiderl[megatron]``)
and skip otherwise. megatron-core's forward needs CUDA; one CPU test replaces its three CUDA-only
helpers (named below, a fake at that edge) to check the forward and backward against our Qwen2,
and the test marked ``gpu`` runs the real backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tiderl.models.qwen2 import Qwen2ForCausalLM, token_logprobs
from tiderl.models.random_init import init_model
from tiderl.trainer import megatron as mg
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.spawn import RankContext, free_port, run_ranks


def tied_model() -> Qwen2ForCausalLM:
    """The tiny model with tied embeddings and Qwen2.5's rope_theta."""
    untied = init_model("tiny")
    config = dataclasses.replace(untied.config, tie_word_embeddings=True, rope_theta=1e6)
    model = Qwen2ForCausalLM(config)
    state = untied.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model.eval()


MODELS = {"untied": lambda: init_model("tiny"), "tied": tied_model}


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (3, 17), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # the prompt
    mask[1, 11:] = 0  # a shorter response, right-padded
    return ids, mask


def test_without_megatron_the_module_imports_and_the_backend_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(mg.BackendUnavailable, match=r"pip install tiderl\[megatron\]"):
        make_backend("megatron", init_model("tiny"))
    with pytest.raises(mg.BackendUnavailable, match=r"pip install tiderl\[megatron\]"):
        mg.qwen2_transformer_config(init_model("tiny").config)


# --- below: megatron-core installed -------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process gloo world with megatron's model-parallel state (TP = PP = 1)."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    mg.init_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_on_cpu_the_backend_refuses_with_a_clear_reason():
    pytest.importorskip("megatron.core")
    with pytest.raises(mg.BackendUnavailable, match="needs CUDA"):
        make_backend("megatron", init_model("tiny"))


def test_transformer_config_mirrors_qwen2():
    pytest.importorskip("megatron.core")
    qwen = init_model("tiny").config
    config = mg.qwen2_transformer_config(qwen, params_dtype=torch.bfloat16)
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (4, 128, 512)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (4, 2, 32)
    assert config.normalization == "RMSNorm" and config.layernorm_epsilon == qwen.rms_norm_eps
    assert config.gated_linear_unit and config.activation_func is F.silu
    assert config.add_qkv_bias and not config.add_bias_linear
    assert config.hidden_dropout == 0.0 and config.attention_dropout == 0.0
    assert config.bf16 and config.params_dtype == torch.bfloat16


@pytest.mark.parametrize("variant", sorted(MODELS))
def test_hf_to_mcore_fills_exactly_the_gpt_model(megatron_world, variant):
    model = MODELS[variant]()
    gpt = mg.build_gpt_model(model.config, use_cpu_initialization=True)
    converted = mg.hf_to_mcore(model.state_dict(), model.config)
    expected = mg.mcore_weights(gpt)
    assert sorted(converted) == sorted(expected)
    assert ("output_layer.weight" in converted) == (variant == "untied")
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in expected.items()}
    mg.load_mcore_state_dict(gpt, converted)  # strict
    loaded = mg.mcore_weights(gpt)
    assert all(torch.equal(loaded[k], v) for k, v in converted.items())
    assert gpt.rotary_pos_emb.inv_freq[1].item() == pytest.approx(
        model.config.rope_theta ** (-2 / model.config.head_dim))


@pytest.mark.parametrize("variant", sorted(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conversion_round_trips_bit_exactly(variant, dtype):
    model = MODELS[variant]().to(dtype)
    state = model.state_dict()
    back = mg.mcore_to_hf(mg.hf_to_mcore(state, model.config), model.config)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], v) and back[k].dtype == dtype for k, v in state.items())


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_slices_merge_back_bit_exactly_and_cut_whole_query_groups(tp):
    model = init_model("tiny")
    whole = mg.hf_to_mcore(model.state_dict(), model.config)
    shards = [mg.tp_shard(whole, tp, rank) for rank in range(tp)]
    merged = mg.tp_merge(shards)
    assert sorted(merged) == sorted(whole)
    assert all(torch.equal(merged[k], v) for k, v in whole.items())
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    rows = (model.config.num_attention_heads // model.config.num_key_value_heads + 2) \
        * model.config.head_dim  # one query group: its query heads, k and v
    assert shards[-1][qkv].shape[0] == rows * model.config.num_key_value_heads // tp
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, _ = whole[fc1].chunk(2)
    assert torch.equal(shards[0][fc1][:gate.shape[0] // tp], gate[:gate.shape[0] // tp])


def test_qkv_rows_are_grouped_per_key_value_head():
    """Megatron's layout, spelled out: group g holds its query heads, then k_g, then v_g."""
    config = init_model("tiny").config  # 4 query heads, 2 kv heads, head_dim 32
    dim = config.head_dim
    q = torch.arange(4).repeat_interleave(dim).float()  # row r of q_proj belongs to head r // dim
    k = 10 + torch.arange(2).repeat_interleave(dim).float()
    v = 20 + torch.arange(2).repeat_interleave(dim).float()
    fused = mg._fuse_qkv(q, k, v, config)
    heads = fused.reshape(-1, dim)[:, 0].tolist()
    assert heads == [0, 1, 10, 20, 2, 3, 11, 21]


@pytest.fixture
def cuda_free_megatron(monkeypatch, megatron_world):
    """Fake at the CUDA edge: megatron-core 0.16's forward reaches CUDA in three helpers only
    (feasibility §8b); each is replaced by its CPU equivalent, nothing else is touched.

    - ``torch.cuda.current_device``: the device of the attention buffer and of the rotary table;
    - ``fused_softmax.get_default_causal_mask``: builds the mask with ``device="cuda"``;
    - ``tensor_parallel.get_cuda_rng_tracker``: forks the CUDA RNG around the (zero) dropout.
    """
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax

    class NoRngTracker:
        def fork(self, *args, **kwargs) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(fused_softmax, "get_default_causal_mask",
                        lambda sq: torch.ones(sq, sq).triu(1).bool())
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: NoRngTracker())


@pytest.mark.parametrize("variant", sorted(MODELS))
def test_gpt_model_forward_and_backward_match_qwen2_on_cpu(cuda_free_megatron, variant):
    model = MODELS[variant]()
    gpt = mg.build_gpt_model(model.config, use_cpu_initialization=True)
    mg.load_mcore_state_dict(gpt, mg.hf_to_mcore(model.state_dict(), model.config))
    ids, mask = batch(model.config.vocab_size)
    positions = torch.arange(ids.shape[1]).expand_as(ids)

    ours = token_logprobs(model, ids, mask)
    theirs = token_logprobs(lambda x: gpt(x, positions, None), ids, mask)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert theirs[:, 0].eq(0).all() and theirs[mask == 0].eq(0).all()

    ours.sum().backward()
    theirs.sum().backward()
    grads = mg.mcore_to_hf({k: p.grad for k, p in gpt.named_parameters()}, model.config)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-3, atol=1e-5)


def _train_one_step_on_cuda(ctx: RankContext, variant: str) -> dict[str, float]:
    model = MODELS[variant]().to(ctx.device)
    backend = make_backend("megatron", model, trainable=True)
    ids, mask = (t.to(ctx.device) for t in batch(model.config.vocab_size))
    with torch.no_grad():
        logprob_error = (backend.logprobs(ids, mask) - token_logprobs(model, ids, mask)).abs().max()
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}  # views of live weights
    optimizer = torch.optim.AdamW(backend.parameters(), lr=1e-3)
    loss = -backend.logprobs(ids, mask).sum() / mask.sum()
    with backend.grad_sync(True):
        loss.backward()
    optimizer.step()
    after = backend.full_state_dict()
    unchanged = [k for k in before if k.endswith("weight") and torch.equal(after[k], before[k])]
    backend.load_full_state_dict(before)
    restored = all(torch.equal(v, before[k]) for k, v in backend.full_state_dict().items())
    model.load_state_dict(after)  # the trained weights, back in our model, give the same logprobs
    backend.load_full_state_dict(after)
    with torch.no_grad():
        trained_error = (backend.logprobs(ids, mask) - token_logprobs(model, ids, mask)).abs().max()
    return {"logprob_error": logprob_error.item(), "unchanged": unchanged,
            "restored": restored, "trained_error": trained_error.item()}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(MODELS))
def test_backend_on_cuda_matches_qwen2_and_trains(variant):
    pytest.importorskip("megatron.core")
    [result] = run_ranks(_train_one_step_on_cuda, 1, variant, device="cuda")
    assert result["logprob_error"] < 1e-4
    assert result["unchanged"] == []  # AdamW's first step moves every weight matrix and norm
    assert result["restored"]
    assert result["trained_error"] < 1e-4
