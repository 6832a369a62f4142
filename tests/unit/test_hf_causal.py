"""An HF causal LM of another architecture (a tiny random-init Llama, saved and loaded as a local
folder) behind the trainer's forward (tiderl.models.hf_causal): the packed logprobs equal the
ones from its own logits and the parameters keep the folder's names. That a two-rank DDP or
FSDP2 step trains what one process trains is tests/integration/test_hf_causal_ranks.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_llama import write_tiny_llama
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.launch.job import check_architecture
from tiderl.launch.local import LaunchError
from tiderl.models.config import ModelConfig
from tiderl.models.folder import save_state_dict
from tiderl.models.hf_causal import HFCausalLM, load_hf_causal
from tiderl.models.loading import model_from_config
from tiderl.models.qwen2 import packed_token_logprobs
from tiderl.models.vocab import VOCAB as WORDS
from tiderl.profile import load_profile
from tiderl.trainer.parallel import make_backend

VOCAB = len(WORDS)  # the word-level tokenizer's: the folder carries its tokenizer.json


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 12), generator=generator)
    mask = torch.zeros(3, 12, dtype=torch.long)
    mask[0, 4:12] = 1
    mask[1, 2:7] = 1  # ends early: later tokens are padding
    mask[2, 9:11] = 1
    return ids, mask


def test_packed_logprobs_equal_the_models_own_logits_and_names_are_the_folders(folder):
    model = load_hf_causal(folder)
    ids, mask = _batch()
    got = packed_token_logprobs(model, ids, mask, chunk_tokens=4)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    with torch.no_grad():
        logits = hf(input_ids=ids).logits[:, :-1].float()
    want = torch.cat((torch.zeros(3, 1), logits.log_softmax(-1).gather(
        -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)), dim=1) * mask
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == set(hf.state_dict())
    got.sum().backward()
    assert model.lm_head.weight.grad is not None
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_a_model_without_a_base_or_an_output_embedding_is_refused():
    with pytest.raises(ValueError, match="not a causal LM"):
        HFCausalLM(torch.nn.Linear(2, 2))


def test_a_job_loads_another_architecture_through_transformers_and_writes_it_back(
        folder, tmp_path):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    model, _ = model_from_config(ModelConfig(path=str(folder)))
    assert isinstance(model, HFCausalLM)
    assert model.config.eos_token_id == (1, 7)  # config.json's 1, generation_config's 7
    assert model.config.max_position_embeddings == 512 and model.config.vocab_size == VOCAB
    save_state_dict(model.state_dict(), model.config, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "llama"
    again = load_hf_causal(tmp_path / "export")
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="the embedded engine runs Qwen2"):
        LLMEngine(model, EngineConfig(kv_cache_tokens=256), model.config.eos_token_id)


def test_activation_checkpointing_uses_the_models_own(folder):
    model = load_hf_causal(folder)
    make_backend("ddp", model, activation_checkpointing=True)
    base = model.base
    assert (base.is_activation_checkpointing if hasattr(base, "activation_checkpointing_enable")
            else base.is_gradient_checkpointing)


@pytest.mark.parametrize(("overrides", "says"), [
    ([], "engine.backend embedded runs Qwen2 and Qwen2-VL only"),
    (["engine.backend=http"], "engine.backend http runs Qwen2 and Qwen2-VL only"),
    (["engine.backend=vllm", "trainer.backend=megatron", "runtime.device=cuda"],
     "trainer.backend megatron builds Qwen2 only"),
])
def test_launch_refuses_an_engine_or_trainer_that_cannot_run_the_architecture(
        folder, overrides, says):
    profile = load_profile("local", [f"model.path={folder}", *overrides])
    with pytest.raises(LaunchError, match=says):
        check_architecture(profile)
