"""Weight sync between two real rank processes (gloo): bucketed broadcast of the actor's state,
and a rank joining the actors with the source's weights and AdamW state. One spawned group runs
every scenario (``synced``); the bucket plans are checked in this process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import pack
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.spawn import RankContext, run_ranks
from tiderl.trainer.sync import (
    LayoutMismatchError,
    load_weights,
    param_layout,
    plan_buckets,
    state_layout,
    sync_params,
)
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.worker import ActorWorker, optimizer_layout

SMALL_BUCKET = 64 << 10
BUCKET_SIZES = (SMALL_BUCKET, 64 << 20, 0)
VERSION = 7


def perturbed(model: Qwen2ForCausalLM, seed: int) -> Qwen2ForCausalLM:
    """Random biases and norms too, so that every tensor matters in a comparison."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def mixed_state() -> dict[str, torch.Tensor]:
    """bf16 and fp32 tensors interleaved by name, one of them larger than SMALL_BUCKET."""
    generator = torch.Generator().manual_seed(3)
    shapes = {"a.big": (200, 100), "b.bias": (17,), "c.w": (33, 5), "d.norm": (64,), "e.w": (3, 4)}
    return {name: torch.randn(shape, generator=generator).to(
        torch.bfloat16 if i % 2 == 0 else torch.float32)
        for i, (name, shape) in enumerate(shapes.items())}


def _sync_rank(ctx: RankContext, arg: None) -> bytes:
    is_src = ctx.rank == 0
    model = perturbed(init_model("tiny", seed=0 if is_src else 1), seed=ctx.rank)
    layout = param_layout(model)
    state = model.state_dict() if is_src else None
    out: dict = {}
    for bucket_bytes in BUCKET_SIZES:
        result = sync_params(state, layout, VERSION if is_src else None, src=0,
                             bucket_bytes=bucket_bytes)
        out[f"state/{bucket_bytes}"] = result.state
        out[f"version/{bucket_bytes}"] = result.version
        out[f"bytes/{bucket_bytes}"] = result.num_bytes
    mixed = mixed_state()
    out["mixed"] = sync_params(mixed if is_src else None, state_layout(mixed),
                               1 if is_src else None, src=0, bucket_bytes=SMALL_BUCKET).state
    ids = torch.randint(0, model.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(0))
    if not is_src:  # the rollout side: the engine loads what the last sync delivered
        engine = LLMEngine(model, EngineConfig(kv_cache_tokens=256), eos_token_id=None)
        engine.update_weights(result.state, result.version)
        out["engine_version"] = engine.version
    with torch.no_grad():
        out["logits"] = model(ids)
    out["errors"] = _mismatch_errors(ctx, model, layout)
    out["fsdp2_full"] = make_backend("fsdp2", init_model("tiny", seed=2)).full_state_dict()
    out["joined"] = _join(ctx)
    return out


def _mismatch_errors(ctx: RankContext, model: Qwen2ForCausalLM, layout: list) -> list[str]:
    """What each rank raises for a receiver layout that lacks an entry, then for a source state
    that lacks one; the ranks stay in step, so later syncs still work."""
    errors = []
    cases = ((model.state_dict(), layout if ctx.rank == 0 else layout[1:]),
             ({k: v for k, v in model.state_dict().items() if k != layout[0][0]}, layout))
    for state, rank_layout in cases:
        try:
            sync_params(state if ctx.rank == 0 else None, rank_layout,
                        0 if ctx.rank == 0 else None, src=0)
            errors.append("none")
        except (LayoutMismatchError, ValueError) as exc:
            errors.append(type(exc).__name__)
    return errors


JOIN_CONFIG = TrainerConfig(lr=1e-2, kl_beta=0.0)


def _actor_step(actor: ActorWorker, seed: int) -> None:
    batch = pack(synthetic_samples(4, vocab_size=1568, min_tokens=8, max_tokens=24, seed=seed))
    actor.train(batch, None, sync=True)
    actor.optimizer_step(batch.num_loss_tokens)


def _join(ctx: RankContext) -> dict[str, torch.Tensor]:
    """Rank 0 is the source actor after one step; rank 1 has only its own initial model (as a
    rank taking the actor role has), receives weights and AdamW state, builds its actor from
    them. Both then take the same step."""
    alone = [dist.new_group([r]) for r in range(ctx.world_size)][ctx.rank]  # no DDP across
    model = init_model("tiny", seed=ctx.rank)
    layout, moments = param_layout(model), optimizer_layout(model)
    actor = ActorWorker(make_backend("ddp", model, alone), JOIN_CONFIG) if ctx.rank == 0 else None
    if actor is not None:
        _actor_step(actor, seed=1)
    source = {k: v.clone() for k, v in actor.backend.full_state_dict().items()} if actor else None
    weights = sync_params(source, layout, 1 if actor else None, src=0).state
    state = sync_params(actor.optimizer_state() if actor else None, moments,
                        1 if actor else None, src=0).state
    if actor is None:
        load_weights(model, weights)
        actor = ActorWorker(make_backend("ddp", model, alone), JOIN_CONFIG)
        actor.load_optimizer_state(state)
    _actor_step(actor, seed=2)
    return actor.backend.full_state_dict()


@pytest.fixture(scope="module")
def synced() -> list[dict]:
    return run_ranks(_sync_rank, 2, timeout_s=120)


def test_plan_buckets_cuts_by_size_and_dtype() -> None:
    layout = param_layout(init_model("tiny"))
    per_tensor = plan_buckets(layout, 0)
    small = plan_buckets(layout, SMALL_BUCKET)
    assert len(per_tensor) == len(layout)
    assert len(plan_buckets(layout, 64 << 20)) == 1
    assert len(layout) > len(small) > 1
    embed = next(b for b in small if b.entries[0][0] == "model.embed_tokens.weight")
    assert len(embed.entries) == 1 and embed.numel * 4 > SMALL_BUCKET  # larger: alone
    assert all(b.numel * 4 <= SMALL_BUCKET for b in small if len(b.entries) > 1)
    big, vec = ((160, 128), torch.float32), ((16,), torch.float32)
    alternating = [(f"{i}.{kind}", *spec) for i in range(2) for kind, spec in (("w", big),
                                                                              ("v", vec))]
    assert [[e[0] for e in b.entries] for b in plan_buckets(alternating, SMALL_BUCKET)] == [
        ["0.w"], ["1.w"], ["0.v", "1.v"]]  # small tensors between big ones travel together
    mixed = plan_buckets(state_layout(mixed_state()), 64 << 20)
    assert [b.dtype for b in mixed] == [torch.bfloat16, torch.float32]
    assert [[e[0] for e in b.entries] for b in mixed] == [["a.big", "c.w", "e.w"],
                                                         ["b.bias", "d.norm"]]


def test_param_layout_skips_tied_lm_head() -> None:
    model = init_model("tiny")
    assert "lm_head.weight" in [name for name, _, _ in param_layout(model)]
    model = Qwen2ForCausalLM(dataclasses.replace(model.config, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [name for name, _, _ in param_layout(model)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert names == sorted(names)


@pytest.mark.parametrize("bucket_bytes", BUCKET_SIZES)
def test_receiver_gets_the_senders_tensors_and_version(synced: list[dict],
                                                       bucket_bytes: int) -> None:
    sent, received = synced[0][f"state/{bucket_bytes}"], synced[1][f"state/{bucket_bytes}"]
    assert received.keys() == sent.keys()
    assert all(torch.equal(received[name], sent[name]) for name in sent)
    assert synced[1][f"version/{bucket_bytes}"] == VERSION
    num_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    assert synced[0][f"bytes/{bucket_bytes}"] == synced[1][f"bytes/{bucket_bytes}"] == num_bytes


def test_mixed_bf16_and_fp32_state(synced: list[dict]) -> None:
    received = synced[1]["mixed"]
    for name, tensor in mixed_state().items():
        assert received[name].dtype == tensor.dtype
        assert torch.equal(received[name], tensor)


def test_engine_loaded_from_sync_gives_the_senders_logits(synced: list[dict]) -> None:
    assert synced[1]["engine_version"] == VERSION
    assert torch.equal(synced[1]["logits"], synced[0]["logits"])


def test_mismatched_layouts_raise_on_every_rank(synced: list[dict]) -> None:
    assert synced[0]["errors"] == ["LayoutMismatchError", "ValueError"]
    assert synced[1]["errors"] == ["LayoutMismatchError", "LayoutMismatchError"]


def test_fsdp2_full_state_dict_is_the_unsharded_model(synced: list[dict]) -> None:
    expected = init_model("tiny", seed=2).state_dict()
    for rank in (0, 1):
        full = synced[rank]["fsdp2_full"]
        assert full.keys() == expected.keys()
        assert all(torch.equal(full[name], expected[name]) for name in expected)


def test_a_joining_rank_gets_the_sources_optimizer_state_over_the_broadcast(
        synced: list[dict]) -> None:
    source, joiner = synced[0]["joined"], synced[1]["joined"]
    assert source.keys() == joiner.keys()
    assert all(torch.equal(joiner[k], source[k]) for k in source)
