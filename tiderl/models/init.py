"""Seeded random-init models for tests and the embedded CPU default (no downloads).

Sizes follow docs/research feasibility §2: ``tiny`` is 128 hidden / 4 layers / 4 heads / 2 KV
heads, ``small`` 256 / 8 / 8 / 4, both with a 4x MLP and untied embeddings. The vocabulary is
the word list of :mod:`tiderl.models.vocab`, or a byte-level BPE trained here
(:mod:`tiderl.models.bpe`). The same size, seed and tokenizer give byte-identical files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiderl.models.config import TOKENIZER_KINDS
from tiderl.models.loading import (
    CONFIG_FILE,
    INDEX_FILE,
    TOKENIZER_EXTRAS,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    save_model,
)
from tiderl.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from tiderl.models.tokenizer import word_tokenizer
from tiderl.models.vocab import BOS, EOS, VOCAB

SIZES = {"tiny": (128, 4, 4, 2), "small": (256, 8, 8, 4)}  # hidden, layers, heads, kv heads
INIT_STD = 0.02


def size_config(size: str, vocab_size: int = len(VOCAB), bos: int | None = VOCAB.index(BOS),
                eos: int | tuple[int, ...] = VOCAB.index(EOS)) -> Qwen2Config:
    """The architecture of ``size``; the vocabulary is the word list's unless given."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r} (known: {', '.join(SIZES)})")
    hidden, layers, heads, kv_heads = SIZES[size]
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=4096, torch_dtype="float32", bos_token_id=bos,
        eos_token_id=eos)


def init_model(size: str, seed: int = 0, config: Qwen2Config | None = None
               ) -> Qwen2ForCausalLM:
    """A float32 CPU model: matrices and embeddings ~ N(0, 0.02), biases 0, norms 1 (as HF
    initialises Qwen2), drawn from one generator in parameter order. ``config``: another
    vocabulary's (``size_config(size, ...)``)."""
    model = Qwen2ForCausalLM(config or size_config(size))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)
    return model.eval()


def write_random_checkpoint(size: str, out: str | Path, seed: int = 0,
                            tokenizer: str = "word") -> list[Path]:
    """Write config.json, model.safetensors and the tokenizer for ``init_model(size, seed)``;
    returns the paths. ``tokenizer``: ``word`` (tokenizer.json of the word list) or ``bpe`` (a
    byte-level BPE trained here with a chat template and generation_config.json, see
    :mod:`tiderl.models.bpe`). Model files another checkpoint left in ``out`` are removed first
    (a shard index, its shards, tokenizer extras): they would be read with this one."""
    folder = Path(out)
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {tokenizer!r} (known: {', '.join(TOKENIZER_KINDS)})")
    _remove_model_files(folder)
    if tokenizer == "word":
        save_model(init_model(size, seed), folder)
        word_tokenizer().save(str(folder / TOKENIZER_FILE), pretty=True)
        return [folder / CONFIG_FILE, folder / WEIGHTS_FILE, folder / TOKENIZER_FILE]
    from tiderl.models.bpe import ENDOFTEXT, IM_END, train_bpe, write_tokenizer_files

    bpe = train_bpe()
    config = size_config(size, bpe.get_vocab_size(), None,
                         (bpe.token_to_id(IM_END), bpe.token_to_id(ENDOFTEXT)))
    save_model(init_model(size, seed, config), folder)
    return [folder / CONFIG_FILE, folder / WEIGHTS_FILE, *write_tokenizer_files(bpe, folder)]


def _remove_model_files(folder: Path) -> None:
    """The files of an HF model folder that a new checkpoint does not overwrite but loading
    would read: ``model.safetensors.index.json`` (it wins over model.safetensors), its shards,
    and the tokenizer extras (a chat template, an eos set)."""
    for name in (INDEX_FILE, *TOKENIZER_EXTRAS):
        (folder / name).unlink(missing_ok=True)
    for shard in folder.glob("model-*-of-*.safetensors"):
        shard.unlink()
