"""GRPO loss, packing, deferred loss and gradient normalisation (one process, no group)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tiderl.core.config import ConfigError
from tiderl.core.types import Trajectory, Turn
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import pack
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.loss import LossStats, grpo_loss_sum
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.sample import TrainSample
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.worker import ActorWorker, RefWorker


def loop_loss(logp, old, adv, mask, ref, clip_eps, beta) -> float:
    """The loss written token by token in plain Python, as the formula reads."""
    total = 0.0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - old[b][t])
            clipped = min(max(ratio, 1 - clip_eps), 1 + clip_eps)
            pg = -min(ratio * adv[b], clipped * adv[b])
            kl = 0.0
            if beta:
                d = ref[b][t] - logp[b][t]
                kl = math.exp(d) - d - 1
            total += pg + beta * kl
    return total


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_loss_matches_a_token_by_token_implementation(beta):
    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 9, generator=gen, dtype=torch.float64) * 3
    old = logp + (torch.rand(4, 9, generator=gen, dtype=torch.float64) - 0.5)
    ref = logp + (torch.rand(4, 9, generator=gen, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.5, -0.7, 0.0, 0.3], dtype=torch.float64)
    mask = (torch.rand(4, 9, generator=gen) > 0.4).double()
    got, stats = grpo_loss_sum(logp, old, adv, mask, ref, clip_eps=0.2, kl_beta=beta)
    want = loop_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), ref.tolist(),
                     0.2, beta)
    assert float(got) == pytest.approx(want, rel=1e-12)
    assert stats.loss_tokens == float(mask.sum())
    assert stats.loss_sum == pytest.approx(want, rel=1e-12)


def test_loss_hand_computed():
    # one sequence, tokens 1 and 2 are model tokens, advantage 2
    logp = torch.tensor([[0.0, math.log(0.5), math.log(0.2)]], dtype=torch.float64)
    old = torch.tensor([[0.0, math.log(0.25), math.log(0.2)]], dtype=torch.float64)
    ref = torch.tensor([[0.0, math.log(0.5), math.log(0.4)]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([2.0], dtype=torch.float64)
    loss, stats = grpo_loss_sum(logp, old, adv, mask, ref, clip_eps=0.2, kl_beta=0.1)
    # token 1: ratio 2 -> clipped to 1.2, pg = -min(4, 2.4) = -2.4; kl: d = 0 -> 0
    # token 2: ratio 1, pg = -2; kl: d = log 2 -> 2 - log 2 - 1
    want = -2.4 + -2.0 + 0.1 * (2 - math.log(2) - 1)
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert stats.clipped_tokens == 1.0
    assert stats.kl_sum == pytest.approx(1 - math.log(2), rel=1e-12)
    assert stats.ratio_sum == pytest.approx(3.0, rel=1e-12)


def test_kl_needs_ref_logprobs():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref logprobs"):
        grpo_loss_sum(x, x, torch.zeros(1), x, None, clip_eps=0.2, kl_beta=0.1)


def test_loss_stats_add_and_round_trip():
    a = LossStats(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    a += LossStats(1.0, 1.0, 1.0, 1.0, 1.0, 2.0)
    assert LossStats.from_tensor(a.as_tensor()) == LossStats(2.0, 3.0, 4.0, 5.0, 6.0, 8.0)
    assert a.means()["loss"] == pytest.approx(2.0 / 8.0)


def test_sample_from_trajectory_masks_context_tokens():
    traj = Trajectory("t1", "g1", [Turn([5, 6], [7, 8], [-0.1, -0.2], version=3),
                                   Turn([9], [10], [-0.3], version=4)], reward=1.0)
    [sample] = TrainSample.from_trajectory(traj, advantage=0.5)
    assert sample.input_ids == (5, 6, 7, 8, 9, 10)
    assert sample.loss_mask == (0, 0, 1, 1, 0, 1)
    assert sample.logprobs == (0.0, 0.0, -0.1, -0.2, 0.0, -0.3)
    assert (sample.version, sample.num_loss_tokens, sample.advantage) == (3, 3, 0.5)


def test_pack_right_pads_with_mask_zero():
    a = TrainSample("a", (1, 2, 3), (0, 1, 1), (0.0, -1.0, -2.0), 1.0)
    b = TrainSample("b", (4, 5), (0, 1), (0.0, -3.0), -1.0)
    batch = pack([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.old_logprobs.tolist() == [[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]]
    assert batch.advantages.tolist() == [1.0, -1.0]
    assert batch.num_loss_tokens == 3
    empty = pack([])
    assert empty.seq_ids == () and empty.num_loss_tokens == 0


def test_sample_rejects_a_loss_on_the_first_token():
    with pytest.raises(ValueError, match="first token"):
        TrainSample("x", (1, 2), (1, 1), (-1.0, -1.0), 0.0)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_deferred_loss_gradients_equal_ordinary_gradients():
    samples = synthetic_samples(6, vocab_size=1568, min_tokens=16, max_tokens=40, seed=2)
    first, second = pack(samples[:3]), pack(samples[3:])
    config = TrainerConfig(kl_beta=0.05)
    ref = RefWorker(make_backend("ddp", init_model("tiny", seed=1), trainable=False))
    ref_first, ref_second = ref.ref_logprobs(first), ref.ref_logprobs(second)

    ordinary = ActorWorker(make_backend("ddp", init_model("tiny", seed=0)), config)
    ordinary.train(first, ref_first, sync=True)
    ordinary.train(second, ref_second, sync=True)

    deferred = ActorWorker(make_backend("ddp", init_model("tiny", seed=0)), config)
    # both forwards first (the ref logprobs are "in flight"), then the losses, out of order
    pending_first = deferred.forward(first, sync=True)
    pending_second = deferred.forward(second, sync=True)
    deferred.backward(pending_second, ref_second)
    deferred.backward(pending_first, ref_first)

    want, got = _grads(ordinary.backend.module), _grads(deferred.backend.module)
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_optimizer_step_normalises_by_the_global_loss_tokens():
    samples = synthetic_samples(4, vocab_size=1568, min_tokens=16, max_tokens=32, seed=5)
    batch = pack(samples)
    config = TrainerConfig(kl_beta=0.0, grad_clip=0.0, lr=1.0)  # the rate each step runs at
    model = init_model("tiny", seed=0)
    reference = copy.deepcopy(model)

    actor = ActorWorker(make_backend("ddp", model), config)
    # SGD makes the update the gradient itself (AdamW would hide a scale error)
    actor.optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    actor.train(batch, None, sync=True)
    stats = actor.optimizer_step(global_loss_tokens=3 * batch.num_loss_tokens)
    assert (stats.version, actor.version) == (1, 1)

    # the same update from a loss already divided by N
    from tiderl.models.qwen2 import token_logprobs

    opt = torch.optim.SGD(reference.parameters(), lr=1.0)
    logp = token_logprobs(reference, batch.input_ids, batch.loss_mask)
    loss, _ = grpo_loss_sum(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, None,
                            clip_eps=config.clip_eps, kl_beta=0.0)
    (loss / (3 * batch.num_loss_tokens)).backward()
    opt.step()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)


def decoupled_grads(logp_values, old, adv, cap):
    """The decoupled objective's loss and its gradient with respect to the logprobs."""
    logp = torch.tensor([logp_values], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0.0] + [1.0] * (len(logp_values) - 1)], dtype=torch.float64)
    loss, stats = grpo_loss_sum(logp, torch.tensor([old], dtype=torch.float64),
                                torch.tensor([adv], dtype=torch.float64), mask, None,
                                clip_eps=0.2, kl_beta=0.0, is_weight_cap=cap)
    loss.backward()
    return float(loss.detach()), logp.grad[0].tolist(), stats


def test_decoupled_objective_weighs_stale_tokens_instead_of_clipping_them():
    # token 1 on-policy; token 2 sampled by a policy that gave it half the probability (w = 2);
    # token 3 by one that gave it a tenth (w = 10 > the cap of 5)
    logp = [0.0, math.log(0.5), math.log(0.5), math.log(0.5)]
    old = [0.0, math.log(0.5), math.log(0.25), math.log(0.05)]
    loss, grad, stats = decoupled_grads(logp, old, 2.0, cap=5.0)
    # pg_t = -w_t · A at r_t = 1; its gradient in logp_t is -w_t · A; the capped token gives none
    assert loss == pytest.approx(-2.0 - 4.0, rel=1e-12)
    assert grad == pytest.approx([0.0, -2.0, -4.0, 0.0], rel=1e-12)
    assert stats.clipped_tokens == 1.0 and stats.ratio_sum == pytest.approx(13.0, rel=1e-12)
    # plain PPO clips token 2 (ratio 2 > 1.2 with A > 0): no gradient from it
    ppo = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    grpo_loss_sum(ppo, torch.tensor([old], dtype=torch.float64),
                  torch.tensor([2.0], dtype=torch.float64), mask, None, clip_eps=0.2,
                  kl_beta=0.0)[0].backward()
    assert ppo.grad[0].tolist() == pytest.approx([0.0, -2.0, 0.0, 0.0], rel=1e-12)


def test_decoupled_objective_is_ppo_on_policy():
    logp = [0.0, math.log(0.3), math.log(0.6)]
    loss, grad, _ = decoupled_grads(logp, logp, -1.5, cap=5.0)
    ppo = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)
    want, _ = grpo_loss_sum(ppo, torch.tensor([logp], dtype=torch.float64),
                            torch.tensor([-1.5], dtype=torch.float64), mask, None,
                            clip_eps=0.2, kl_beta=0.0)
    want.backward()
    assert loss == pytest.approx(float(want.detach()), rel=1e-12)
    assert grad == pytest.approx(ppo.grad[0].tolist(), rel=1e-12)


def test_the_objective_is_checked():
    with pytest.raises(ConfigError, match="objective"):
        TrainerConfig(objective="dpo")
    with pytest.raises(ConfigError, match="is_weight_cap"):
        TrainerConfig(objective="decoupled", is_weight_cap=1.0)
    assert TrainerConfig().loss_is_weight_cap is None
    assert TrainerConfig(objective="decoupled").loss_is_weight_cap == 5.0
