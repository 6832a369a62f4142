"""Seeded random-init models for tests and the embedded CPU default (no downloads).

Sizes follow docs/research feasibility §2: ``tiny`` is 128 hidden / 4 layers / 4 heads / 2 KV
heads, ``small`` 256 / 8 / 8 / 4, both with a 4x MLP and untied embeddings. ``tiny-vl`` is a
Qwen2-VL whose language part is ``tiny`` (mrope sections 4, 6, 6 of its 16 frequency pairs) with
a vision tower of 2 blocks, width 64, 4 heads, QuickGELU MLP of 256, 14-pixel patches, 2
frames, 2 x 2 patches per LLM token. The vocabulary is the word list of
:mod:`tiderl.models.vocab`, or a byte-level BPE trained here (:mod:`tiderl.models.bpe`); a
vision size appends the three vision tokens (:func:`~tiderl.models.tokenizer.with_vision_tokens`,
the last three ids). The same size, seed and tokenizer give byte-identical files.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from tiderl.core.quote import short
from tiderl.models.config import TOKENIZER_KINDS
from tiderl.models.folder import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    TOKENIZER_EXTRAS,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    ModelArchitecture,
    save_model,
)
from tiderl.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, RMSNorm
from tiderl.models.qwen2_vl import Qwen2VLConfig, Qwen2VLForCausalLM
from tiderl.models.tokenizer import with_vision_tokens, word_tokenizer
from tiderl.models.vision import VisionConfig
from tiderl.models.vision_inputs import PREPROCESSOR_FILE, ImageSettings
from tiderl.models.vocab import BOS, EOS, PAD, VISION_TOKENS, VOCAB

SIZES = {"tiny": (128, 4, 4, 2), "small": (256, 8, 8, 4)}  # hidden, layers, heads, kv heads
VISION_SIZES = {"tiny-vl": "tiny"}  # a vision size -> the size of its language part
TINY_VISION = VisionConfig(kind="qwen2_vl", depth=2, width=64, num_heads=4,
                           intermediate_size=256, out_hidden_size=128, hidden_act="quick_gelu",
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
TINY_MROPE_SECTION = (4, 6, 6)  # of head_dim 32: 16 frequency pairs
INIT_STD = 0.02


def is_vision_size(size: str) -> bool:
    return size in VISION_SIZES


def size_config(size: str, vocab_size: int | None = None,
                bos: int | None = VOCAB.index(BOS),
                eos: int | tuple[int, ...] = VOCAB.index(EOS)) -> Qwen2Config:
    """The architecture of ``size`` (a :class:`Qwen2VLConfig` for a vision size, whose last
    three ids are the vision tokens); the vocabulary is the word list's (with the vision
    tokens) unless given."""
    if size in VISION_SIZES:
        vocab_size = vocab_size or len(VOCAB) + len(VISION_TOKENS)
        text = size_config(VISION_SIZES[size], vocab_size, bos, eos)
        start, end, image = (vocab_size - len(VISION_TOKENS) + i for i in range(3))
        return Qwen2VLConfig(**asdict(text), mrope_section=TINY_MROPE_SECTION,
                             image_token_id=image, vision_start_token_id=start,
                             vision_end_token_id=end, vision=TINY_VISION)
    if size not in SIZES:
        known = ", ".join((*SIZES, *VISION_SIZES))
        raise ValueError(f"unknown model size {short(size)} (known: {known})")
    hidden, layers, heads, kv_heads = SIZES[size]
    return Qwen2Config(
        vocab_size=vocab_size or len(VOCAB), hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=4096, torch_dtype="float32", bos_token_id=bos,
        eos_token_id=eos)


def init_model(size: str, seed: int = 0, config: Qwen2Config | None = None
               ) -> ModelArchitecture:
    """A float32 CPU model: matrices and embeddings ~ N(0, 0.02), biases 0, norms 1 (as HF
    initialises Qwen2), drawn from one generator in parameter order. ``config``: another
    vocabulary's (``size_config(size, ...)``). A vision size gives a
    :class:`Qwen2VLForCausalLM`."""
    config = config or size_config(size)
    vision = isinstance(config, Qwen2VLConfig)
    model = Qwen2VLForCausalLM(config) if vision else Qwen2ForCausalLM(config)
    norms = {f"{name}.weight" for name, module in model.named_modules()
             if isinstance(module, (RMSNorm, nn.LayerNorm))}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in norms:
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
    :mod:`tiderl.models.bpe`). A vision size adds the vision tokens to the tokenizer, and
    writes generation_config.json (its eos) and preprocessor_config.json (the image
    processor's settings, :class:`~tiderl.models.vision_inputs.ImageSettings`). Model files
    another checkpoint left in ``out`` are removed first (a shard index, its shards, tokenizer
    extras): they would be read with this one."""
    folder = Path(out)
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {short(tokenizer)} "
                         f"(known: {', '.join(TOKENIZER_KINDS)})")
    _remove_model_files(folder)
    vision = is_vision_size(size)
    if tokenizer == "word":
        words = with_vision_tokens(word_tokenizer()) if vision else word_tokenizer()
        config = size_config(size, words.get_vocab_size())
        save_model(init_model(size, seed, config), folder)
        words.save(str(folder / TOKENIZER_FILE), pretty=True)
        paths = [folder / CONFIG_FILE, folder / WEIGHTS_FILE, folder / TOKENIZER_FILE]
        if vision:
            paths.append(_write_json(folder / GENERATION_CONFIG_FILE, {
                "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                "pad_token_id": VOCAB.index(PAD)}))
    else:
        from tiderl.models.bpe import ENDOFTEXT, IM_END, train_bpe, write_tokenizer_files

        bpe = with_vision_tokens(train_bpe()) if vision else train_bpe()
        config = size_config(size, bpe.get_vocab_size(), None,
                             (bpe.token_to_id(IM_END), bpe.token_to_id(ENDOFTEXT)))
        save_model(init_model(size, seed, config), folder)
        paths = [folder / CONFIG_FILE, folder / WEIGHTS_FILE,
                 *write_tokenizer_files(bpe, folder)]
    if isinstance(config, Qwen2VLConfig):
        vision_config = config.vision
        settings = ImageSettings(patch_size=vision_config.patch_size,
                                 temporal_patch_size=vision_config.temporal_patch_size,
                                 merge_size=vision_config.spatial_merge_size)
        paths.append(_write_json(folder / PREPROCESSOR_FILE, settings.to_hf()))
    return paths


def _write_json(file: Path, content: dict) -> Path:
    file.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return file


def _remove_model_files(folder: Path) -> None:
    """The files of an HF model folder that a new checkpoint does not overwrite but loading
    would read: ``model.safetensors.index.json`` (it wins over model.safetensors), its shards,
    and the tokenizer extras (a chat template, an eos set)."""
    for name in (INDEX_FILE, *TOKENIZER_EXTRAS):
        (folder / name).unlink(missing_ok=True)
    for shard in folder.glob("model-*-of-*.safetensors"):
        shard.unlink()
