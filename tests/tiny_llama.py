"""A tiny random-init Llama folder (another architecture than Qwen2) with the word-level
tokenizer: what a user's own HF model folder looks like to TideRL, small enough for the CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from tiderl.models.tokenizer import word_tokenizer
from tiderl.models.vocab import BOS, EOS, PAD, VOCAB


def write_tiny_llama(folder: Path, seed: int = 0, head_size: int = 8) -> Path:
    """Save the model (2 layers, GQA 4/2 heads of ``head_size``: hidden 32 by default, 128 at
    32, the smallest head vLLM's CPU attention takes) and tokenizer.json to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=4 * head_size, intermediate_size=8 * head_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=VOCAB.index(BOS), eos_token_id=VOCAB.index(EOS),
        pad_token_id=VOCAB.index(PAD)))
    model.save_pretrained(folder)
    word_tokenizer().save(str(folder / "tokenizer.json"))
    return folder
