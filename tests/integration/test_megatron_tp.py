"""Megatron tensor parallelism on the CPU: two real gloo ranks build a TP = 2 ``GPTModel``, load
their slices of our Qwen2's weights (``tp_shard``), and must reproduce Qwen2's logits and, merged
back (``tp_merge``), its gradients and their global norm (``tp_grad_norm``).

megatron-core's forward reaches CUDA in three helpers only; each rank replaces them with their
CPU equivalents (a fake at that edge, as ``tests/unit/test_trainer_megatron.py`` does in
process). Everything else, the TP layers and their collectives included, is megatron's.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.models.random_init import init_model
from tiderl.trainer import megatron as mg
from tiderl.trainer.spawn import RankContext, run_ranks

TP = 2


def _model(tied: bool) -> Qwen2ForCausalLM:
    model = init_model("tiny", seed=0)
    if not tied:
        return model
    tied_model = Qwen2ForCausalLM(dataclasses.replace(model.config, tie_word_embeddings=True))
    state = model.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    tied_model.load_state_dict(state)
    return tied_model


def _cuda_free_megatron() -> None:
    """The three CUDA-only helpers, replaced for this (throwaway) rank process."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax

    class NoRngTracker:
        def fork(self, *args, **kwargs) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq).triu(1).bool()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoRngTracker()


def _rank(ctx: RankContext, variants: tuple[bool, ...]) -> dict[bool, dict]:
    _cuda_free_megatron()
    mg.init_model_parallel(0, TP)
    return {tied: _tp_model(tied) for tied in variants}


def _tp_model(tied: bool) -> dict:
    from megatron.core import parallel_state

    model = _model(tied)
    gpt = mg.build_gpt_model(model.config, use_cpu_initialization=True, parallel_output=False)
    whole = mg.hf_to_mcore(model.state_dict(), model.config)
    mine = mg.tp_shard(whole, TP, parallel_state.get_tensor_model_parallel_rank())
    mg.load_mcore_state_dict(gpt, mine)  # strict: the slices are exactly megatron's shapes
    ids = torch.randint(0, model.config.vocab_size, (2, 11),
                        generator=torch.Generator().manual_seed(0))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    logits = gpt(ids, positions, None)
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in gpt.named_parameters()}
    parts: list = [None] * TP
    dist.all_gather_object(parts, grads, group=parallel_state.get_tensor_model_parallel_group())
    norm = mg.tp_grad_norm(list(gpt.named_parameters()),
                           parallel_state.get_tensor_model_parallel_group())
    return {"logits": logits.detach(), "grads": mg.tp_merge(parts), "norm": norm,
            "shapes": {k: tuple(v.shape) for k, v in mg.mcore_weights(gpt).items()}}


@pytest.fixture(scope="module")
def tp_ranks() -> list[dict[bool, dict]]:
    pytest.importorskip("megatron.core")
    return run_ranks(_rank, TP, (False, True), timeout_s=180)  # one world for both variants


@pytest.mark.parametrize("tied", [False, True])
def test_a_tp2_gpt_model_on_our_slices_is_our_qwen2(tp_ranks, tied):
    ranks = [rank[tied] for rank in tp_ranks]
    model = _model(tied)
    ids = torch.randint(0, model.config.vocab_size, (2, 11),
                        generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    logits.pow(2).mean().backward()
    want_grads = mg.hf_to_mcore({n: p.grad for n, p in model.named_parameters()},
                                model.config)
    want_norm = float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())))
    assert ranks[0]["shapes"] != {k: tuple(v.shape) for k, v in want_grads.items()}  # sliced
    for rank in ranks:
        torch.testing.assert_close(rank["logits"], logits.detach(), atol=1e-5, rtol=0)
        assert sorted(rank["grads"]) == sorted(want_grads)
        for name, grad in want_grads.items():
            torch.testing.assert_close(rank["grads"][name], grad, atol=1e-6, rtol=1e-4,
                                       msg=name)
        assert rank["norm"] == pytest.approx(want_norm, rel=1e-5)
