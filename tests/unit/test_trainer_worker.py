"""A new actor joins with the source actor's weights and AdamW state: packing, the layout every
rank builds alone, loading. The broadcast between two real rank processes (gloo) is
tests/integration/test_trainer_sync.py."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist

from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import pack
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.sync import load_weights, param_layout, state_layout
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.worker import ActorWorker, optimizer_layout

CONFIG = TrainerConfig(lr=1e-2, kl_beta=0.0)
VOCAB = 1568


def _actor(model: Qwen2ForCausalLM, group: dist.ProcessGroup | None = None) -> ActorWorker:
    return ActorWorker(make_backend("ddp", model, group), CONFIG)


def _step(actor: ActorWorker, seed: int) -> None:
    batch = pack(synthetic_samples(4, vocab_size=VOCAB, min_tokens=8, max_tokens=24, seed=seed))
    actor.train(batch, None, sync=True)
    actor.optimizer_step(batch.num_loss_tokens)


def _weights(actor: ActorWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in actor.backend.full_state_dict().items()}


def test_a_fresh_actor_packs_zero_moments_under_the_layout() -> None:
    actor = _actor(init_model("tiny", seed=0))
    state = actor.optimizer_state()
    assert state_layout(state) == optimizer_layout(init_model("tiny", seed=1))
    assert all(not t.any() for t in state.values())
    assert state["model.norm.weight.step"].shape == ()


def test_an_actor_with_the_sources_weights_and_state_takes_the_same_next_step() -> None:
    source = _actor(init_model("tiny", seed=0))
    _step(source, seed=1)
    joiner_model = init_model("tiny", seed=5)
    load_weights(joiner_model, _weights(source))
    joiner = _actor(joiner_model)
    joiner.load_optimizer_state(source.optimizer_state())
    assert joiner.optimizer_state().keys() == source.optimizer_state().keys()
    assert all(torch.equal(joiner.optimizer_state()[k], v)
               for k, v in source.optimizer_state().items())
    _step(source, seed=2)
    _step(joiner, seed=2)
    want = source.backend.full_state_dict()
    assert all(torch.equal(t, want[k]) for k, t in joiner.backend.full_state_dict().items())


def test_load_weights_takes_a_sync_without_the_tied_lm_head() -> None:
    config = dataclasses.replace(init_model("tiny").config, tie_word_embeddings=True)
    source, target = Qwen2ForCausalLM(config), Qwen2ForCausalLM(config)
    with torch.no_grad():
        source.model.embed_tokens.weight.add_(1.0)
    names = {name for name, _, _ in param_layout(source)}
    load_weights(target, {k: v for k, v in source.state_dict().items() if k in names})
    assert torch.equal(target.lm_head.weight, source.model.embed_tokens.weight)
    assert all(torch.equal(t, source.state_dict()[k]) for k, t in target.state_dict().items())


def test_the_lr_schedule_warms_up_then_follows_a_cosine_to_its_floor() -> None:
    config = TrainerConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    rates = [config.lr_at(step, 10) for step in range(10)]
    assert rates[:3] == [0.5, 1.0, 1.0]  # warm-up, then the cosine from its top
    assert rates[-1] == pytest.approx(0.1)  # the last step runs at the floor
    assert all(a > b for a, b in itertools.pairwise(rates[2:]))
    assert rates[6] == dataclasses.replace(config).lr_at(6, 10)  # a function of the step alone
    constant = TrainerConfig(lr=0.3, warmup_steps=3)
    assert [constant.lr_at(s, 10) for s in (0, 2, 3, 9)] == pytest.approx([0.1, 0.3, 0.3, 0.3])


def test_each_optimizer_step_runs_at_the_rate_of_its_version_also_on_a_joiner() -> None:
    config = dataclasses.replace(CONFIG, lr_schedule="cosine", warmup_steps=1)
    actor = ActorWorker(make_backend("ddp", init_model("tiny", seed=0)), config, total_steps=6)
    for seed in range(3):
        _step(actor, seed)
        assert actor.optimizer.param_groups[0]["lr"] == config.lr_at(actor.version - 1, 6)
    joiner = ActorWorker(make_backend("ddp", init_model("tiny", seed=0)), config, version=3,
                         total_steps=6)
    _step(joiner, 9)  # its first step is the job's fourth: the rate of version 3
    assert joiner.optimizer.param_groups[0]["lr"] == config.lr_at(3, 6) < config.lr
