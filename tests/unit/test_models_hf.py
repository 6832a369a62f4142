"""Our Qwen2 against transformers' ``Qwen2ForCausalLM`` on the same saved folder (fp32, CPU).

transformers is a test-only dependency (the ``dev`` extra); without it these tests skip.
"""

import dataclasses

import pytest
import torch

from tiderl.models.folder import save_model
from tiderl.models.loading import load_model
from tiderl.models.qwen2 import Qwen2ForCausalLM, token_logprobs
from tiderl.models.random_init import init_model, size_config
from tiderl.models.vocab import VOCAB

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[dev]')")


def saved_model(folder, tie: bool) -> Qwen2ForCausalLM:
    config = dataclasses.replace(size_config("tiny"), tie_word_embeddings=tie,
                                 rope_theta=1_000_000.0)
    model = Qwen2ForCausalLM(config)
    state = init_model("tiny", seed=7).state_dict()
    model.load_state_dict(state, strict=not tie)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():  # random biases and norms: every parameter must matter
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    save_model(model, folder)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_transformers(tmp_path, tie):
    saved_model(tmp_path, tie)
    reference = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    reference.eval()
    assert reference.config.tie_word_embeddings == tie
    ours = load_model(tmp_path)
    ids = torch.randint(0, len(VOCAB), (3, 48), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = reference(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    mask = torch.ones_like(ids)
    logprobs = torch.log_softmax(expected, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(ours, ids, mask)[:, 1:], logprobs,
                                   atol=1e-5, rtol=1e-5)
