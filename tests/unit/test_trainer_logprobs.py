"""The trainer's log-probabilities: packed (no padding), over loss positions only, in chunks,
against the padded full-logits reference (``token_logprobs``); and activation checkpointing."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tiderl.models.attention import varlen_attention
from tiderl.models.qwen2 import packed_token_logprobs, token_logprobs
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import pack
from tiderl.trainer.loss import grpo_loss_sum
from tiderl.trainer.sample import TrainSample
from tiderl.trainer.synthetic import synthetic_samples


def _batch(model, seed: int = 3):
    """Variable lengths, prompts and observations between turns (mask 0 runs), one sample with
    no loss token at all and one whose last tokens are context."""
    samples = synthetic_samples(7, vocab_size=model.config.vocab_size, min_tokens=6,
                                max_tokens=70, seed=seed)
    ids = samples[0].input_ids
    samples.append(TrainSample("no-loss", ids, (0,) * len(ids), (0.0,) * len(ids), 0.5))
    tail = samples[1]
    mask = (*tail.loss_mask[:-3], 0, 0, 0)
    samples.append(dataclasses.replace(tail, seq_id="tail", loss_mask=mask))
    return pack(samples)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_logprobs_equal_the_padded_ones_at_every_loss_position():
    model = init_model("tiny", seed=0)
    batch = _batch(model)
    with torch.no_grad():
        want = token_logprobs(model, batch.input_ids, batch.loss_mask)
        for chunk in (1, 37, 1024):
            got = packed_token_logprobs(model, batch.input_ids, batch.loss_mask, chunk)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[batch.loss_mask == 0] == 0).all()


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_chunked_loss_and_its_gradients_equal_the_full_ones(checkpointed):
    full, chunked = init_model("tiny", seed=0), init_model("tiny", seed=0)
    for layer in chunked.model.layers:
        layer.checkpointed = checkpointed
    batch = _batch(full, seed=5)
    ref = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    losses = []
    for model, logprobs in ((full, token_logprobs), (chunked, packed_token_logprobs)):
        lp = logprobs(model, batch.input_ids, batch.loss_mask) if logprobs is token_logprobs \
            else logprobs(model, batch.input_ids, batch.loss_mask, 16)
        loss, _ = grpo_loss_sum(lp, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                (lp.detach() + ref) * batch.loss_mask, clip_eps=0.2,
                                kl_beta=0.05)
        loss = loss / batch.num_loss_tokens  # the loss: its mean per loss token
        loss.backward()
        losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
    want, got = _grads(full), _grads(chunked)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)


def test_a_batch_without_loss_tokens_gives_zeros_and_a_zero_gradient_on_every_weight():
    model = init_model("tiny", seed=0)
    batch = pack([])
    out = packed_token_logprobs(model, batch.input_ids, batch.loss_mask)
    assert out.shape == (1, 1) and float(out.detach().abs().sum()) == 0
    out.sum().backward()  # every weight took part: a rank with nothing joins the reduction
    assert all(p.grad is not None and float(p.grad.abs().sum()) == 0
               for p in model.parameters())


def test_varlen_attention_is_each_sequence_alone_under_a_causal_mask():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 12]
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(2))
    cu = [0, 5, 6, 18]
    got = varlen_attention(q, k, v, cu)
    for a, b in itertools.pairwise(cu):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(2, dim=0), vs.repeat_interleave(2, dim=0)
        want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        torch.testing.assert_close(got[a:b], want.transpose(0, 1), atol=1e-6, rtol=0)
