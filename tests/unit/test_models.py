"""The Qwen2 model on CPU: paged attention equals dense, logprobs, save/load, tokenizer, init."""

import dataclasses
import random

import pytest
import torch

from tiderl.models.attention import PagedBatch
from tiderl.models.config import ModelConfig
from tiderl.models.folder import ModelLoadError, load_state_dict, load_tokenizer, save_model
from tiderl.models.loading import load_model, model_from_config
from tiderl.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, token_logprobs
from tiderl.models.random_init import init_model, size_config, write_random_checkpoint
from tiderl.models.tokenizer import word_tokenizer
from tiderl.models.vocab import UNK, VOCAB

BLOCK_SIZE = 4


def perturbed(model: Qwen2ForCausalLM, seed: int = 1) -> Qwen2ForCausalLM:
    """Random biases and norms too, so that every parameter matters in a comparison."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


@pytest.fixture(scope="module")
def model():
    return perturbed(init_model("tiny", seed=0))


def run_paged(model, seqs, schedule, num_blocks=32):
    """Feed ``seqs`` (token lists) through the paged path; ``schedule`` is a list of steps,
    each {seq index: number of new tokens}. Blocks are handed out from a shuffled pool, so block
    tables are not contiguous. Returns {seq index: logits of each of its tokens}."""
    pool = list(range(num_blocks))
    random.Random(0).shuffle(pool)
    cache = model.new_kv_cache(num_blocks, BLOCK_SIZE)
    tables = {s: [] for s in range(len(seqs))}
    done = dict.fromkeys(tables, 0)
    logits = {s: [] for s in tables}
    for step in schedule:
        order = sorted(step)
        for s in order:
            while len(tables[s]) * BLOCK_SIZE < done[s] + step[s]:
                tables[s].append(pool.pop())
        positions, batch = PagedBatch.build([tables[s] for s in order],
                                            [done[s] for s in order],
                                            [step[s] for s in order], BLOCK_SIZE)
        ids = torch.tensor([t for s in order for t in seqs[s][done[s]:done[s] + step[s]]])
        with torch.no_grad():
            out = model.forward_paged(ids, positions, cache, batch)
        for i, s in enumerate(order):
            logits[s].append(out[batch.query_start_loc[i]:batch.query_start_loc[i + 1]])
            done[s] += step[s]
    return {s: torch.cat(rows) for s, rows in logits.items()}


def test_paged_prefill_in_chunks_and_batched_decode_equal_dense(model):
    gen = torch.Generator().manual_seed(2)
    lengths = [13, 5, 22]
    seqs = [torch.randint(0, len(VOCAB), (n + 3,), generator=gen).tolist() for n in lengths]
    schedule = [{0: 7, 1: 5, 2: 3}, {0: 6, 2: 12}, {2: 7}]  # chunked prefill, mixed lengths
    schedule += [dict.fromkeys(range(3), 1)] * 3  # three batched decode steps
    paged = run_paged(model, seqs, schedule)
    for s, tokens in enumerate(seqs):
        with torch.no_grad():
            dense = model(torch.tensor([tokens]))[0]
        assert paged[s].shape == dense.shape
        torch.testing.assert_close(paged[s], dense, atol=1e-5, rtol=1e-5)
        # The engine's behaviour logprobs and the trainer's agree (DESIGN §4 models).
        engine = torch.log_softmax(paged[s][:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])
        with torch.no_grad():
            trainer = token_logprobs(model, torch.tensor([tokens]))[0, 1:]
        torch.testing.assert_close(engine[:, 0], trainer, atol=1e-5, rtol=1e-5)


def test_paged_logits_indices_pick_last_tokens(model):
    positions, batch = PagedBatch.build([[3, 1], [0]], [0, 0], [6, 2], BLOCK_SIZE)
    ids = torch.arange(8)
    cache = model.new_kv_cache(4, BLOCK_SIZE)
    with torch.no_grad():
        last = model.forward_paged(ids, positions, cache, batch, batch.last_token_indices())
        dense = model(torch.arange(6)[None])[0, -1]
    assert last.shape == (2, len(VOCAB))
    torch.testing.assert_close(last[0], dense, atol=1e-5, rtol=1e-5)
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    assert batch.slot_mapping.tolist() == [12, 13, 14, 15, 4, 5, 0, 1]
    with pytest.raises(ValueError, match="too short"):
        PagedBatch.build([[0]], [3], [2], BLOCK_SIZE)


def test_token_logprobs_match_log_softmax_and_mask(model):
    ids = torch.randint(0, len(VOCAB), (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(2, 9)
    mask[:, 5:] = 1
    out = token_logprobs(model, ids, mask)
    assert out.shape == (2, 9) and out.dtype == torch.float32
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).float(), -1)[0, 6].gather(-1, ids[0, 7:8])
    torch.testing.assert_close(out[0, 7:8], expected)
    assert out[:, :5].abs().sum() == 0 and (out[:, 5:] < 0).all()
    out.sum().backward()  # differentiable for the trainer
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_bfloat16_forward_is_close_to_float32(model):
    ids = torch.randint(0, len(VOCAB), (1, 12), generator=torch.Generator().manual_seed(4))
    copy = Qwen2ForCausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    copy = copy.to(torch.bfloat16)
    with torch.no_grad():
        a, b = model(ids), copy(ids)
    assert b.dtype == torch.bfloat16
    assert (a - b.float()).abs().max() < 0.1


@pytest.mark.parametrize("shard", [None, 400_000])
def test_save_load_round_trip_is_identical(model, tmp_path, shard):
    save_model(model, tmp_path, max_shard_bytes=shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    loaded = load_model(tmp_path)
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert load_model(tmp_path, "bfloat16").dtype == torch.bfloat16


def test_tied_embeddings_save_without_lm_head(tmp_path):
    config = dataclasses.replace(size_config("tiny"), tie_word_embeddings=True)
    tied = perturbed(Qwen2ForCausalLM(config))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    save_model(tied, tmp_path)
    assert "lm_head.weight" not in load_state_dict(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, tied.lm_head.weight)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json: not found"):
        load_model(tmp_path)
    save_model(init_model("tiny"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors"):
        load_model(tmp_path)


ENV_SENTENCES = [
    "Guess a number between 1 and 1000. Your guess: 512. Higher!",
    "Too low; try again. You have 3 attempts left.",
    "Search results: item 1, price $12.50, color red, size large. Click buy.",
    "You are in the kitchen. On the countertop you see a mug and an apple.",
    "Go to the fridge, open it, take the egg and put it in the microwave.",
    "Correct! You won the game in 7 turns.",
]


def test_word_tokenizer_covers_env_sentences():
    tokenizer = word_tokenizer()
    unk = tokenizer.token_to_id(UNK)
    for text in ENV_SENTENCES:
        encoding = tokenizer.encode(text)
        unknown = [text[a:b] for (a, b), i in zip(encoding.offsets, encoding.ids, strict=True)
                   if i == unk]
        assert not unknown, unknown
        assert tokenizer.decode(encoding.ids).split() == encoding.tokens
    assert tokenizer.encode("2024 zzz").ids == [unk, unk]
    assert [tokenizer.token_to_id(s) for s in ("<pad>", "<eos>", "<bos>", "<unk>")] == [0, 1, 2, 3]
    assert tokenizer.get_vocab_size() == len(VOCAB) == size_config("tiny").vocab_size


def test_random_checkpoint_is_seeded_and_loads(tmp_path):
    paths = write_random_checkpoint("tiny", tmp_path / "a", seed=5)
    again = write_random_checkpoint("tiny", tmp_path / "b", seed=5)
    other = write_random_checkpoint("tiny", tmp_path / "c", seed=6)
    assert [p.name for p in paths] == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]
    assert paths[1].read_bytes() != other[1].read_bytes()
    model = load_model(tmp_path / "a")
    assert model.config == size_config("tiny")
    assert load_tokenizer(tmp_path / "a").get_vocab_size() == len(VOCAB)
    from_profile, _ = model_from_config(ModelConfig(size="tiny", seed=5))
    assert torch.equal(from_profile.lm_head.weight, model.lm_head.weight)
    loaded, _ = model_from_config(ModelConfig(path=str(tmp_path / "a"), dtype="bfloat16"))
    assert loaded.dtype == torch.bfloat16


def test_sizes_match_the_feasibility_study():
    tiny, small = size_config("tiny"), size_config("small")
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.num_attention_heads,
            tiny.num_key_value_heads, tiny.intermediate_size) == (128, 4, 4, 2, 512)
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads,
            small.num_key_value_heads, small.intermediate_size) == (256, 8, 8, 4, 1024)
    with pytest.raises(ValueError, match="unknown model size"):
        size_config("huge")


def test_config_reads_hf_spellings_and_rejects_unsupported():
    hf = size_config("tiny").to_hf()
    assert Qwen2Config.from_hf(hf) == size_config("tiny")
    v5 = {k: v for k, v in hf.items() if k not in ("rope_theta", "torch_dtype", "eos_token_id")}
    v5 |= {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}, "dtype": "bfloat16",
           "eos_token_id": [1, 2], "rope_scaling": None}
    config = Qwen2Config.from_hf(v5)
    assert (config.rope_theta, config.torch_dtype, config.eos_token_id) == (5.0, "bfloat16",
                                                                            (1, 2))  # every eos
    with pytest.raises(ValueError, match="model_type 'llama'"):
        Qwen2Config.from_hf(hf | {"model_type": "llama"})
    with pytest.raises(ValueError, match="rope scaling"):
        Qwen2Config.from_hf(hf | {"rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="sliding-window"):
        Qwen2Config.from_hf(hf | {"use_sliding_window": True})
