"""Which model an HF-format folder or a profile's model section gives: the architecture
dispatcher above the folder files (:mod:`tiderl.models.folder`).

    config.json model_type   qwen2                  -> Qwen2ForCausalLM    (:mod:`.qwen2`)
                             qwen2_vl, qwen2_5_vl   -> Qwen2VLForCausalLM  (:mod:`.qwen2_vl`)
                             any other              -> HFCausalLM          (:mod:`.hf_causal`)
    no folder (a profile's ``size``)                -> a seeded random init (:mod:`.init`)

A real Qwen2 / Qwen2.5 checkpoint on local disk loads as is, and so does a Qwen2-VL / Qwen2.5-VL
one (:mod:`tiderl.models.qwen2_vl`; weights named as on the hub, ``model.*`` and ``visual.*``,
or as transformers 5 names them in memory, ``model.language_model.*`` and ``model.visual.*``);
nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tiderl.models.config import EMBEDDED_MODEL_TYPES, VL_MODEL_TYPES, ModelConfig, model_type
from tiderl.models.folder import (
    CONFIG_FILE,
    TIED_KEY,
    ModelArchitecture,
    ModelLoadError,
    joined_eos,
    load_state_dict,
    load_tokenizer,
)
from tiderl.models.qwen2 import DTYPES, Qwen2Config, Qwen2ForCausalLM
from tiderl.models.qwen2_vl import Qwen2VLConfig, Qwen2VLForCausalLM
from tiderl.models.vision_inputs import image_settings

# transformers 5's in-memory names of a vision model's weights -> the hub's (ours)
VL_KEY_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def load_config(path: str | Path) -> Qwen2Config:
    """config.json, with generation_config.json's eos tokens joined to its own: a
    :class:`Qwen2VLConfig` for model_type qwen2_vl and qwen2_5_vl, else a Qwen2 one."""
    file = Path(path) / CONFIG_FILE
    try:
        data = json.loads(file.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        kind = Qwen2VLConfig if data.get("model_type") in VL_MODEL_TYPES else Qwen2Config
        config = kind.from_hf(data)
        eos = joined_eos(config.eos_token_id, Path(path))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{file}: not found") from exc
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{file}: {exc}") from exc
    return replace(config, eos_token_id=eos)


def load_model(path: str | Path, dtype: str | torch.dtype | None = None,
               device: torch.device | str = "cpu") -> ModelArchitecture:
    """Build the model from a folder (:class:`Qwen2VLForCausalLM` for a vision model);
    ``dtype`` defaults to the config's ``torch_dtype``."""
    config = load_config(path)
    model = _empty_model(config, dtype or config.torch_dtype, device)
    state = {_hub_name(k): v for k, v in load_state_dict(path).items()
             if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints saved the rope table
    if config.tie_word_embeddings:
        state.pop(TIED_KEY, None)
    missing, unexpected = _check_keys(model, state)
    if missing or unexpected:
        raise ModelLoadError(f"{path}: weights do not match config.json "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    expected = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} not {tuple(expected[k].shape)}"
             for k, v in state.items() if v.shape != expected[k].shape]
    if wrong:
        raise ModelLoadError(f"{path}: weights do not match config.json ({', '.join(wrong[:3])})")
    model.load_state_dict(state, strict=False)  # tied lm_head shares the embedding
    if isinstance(model, Qwen2VLForCausalLM):
        try:
            model.image_settings = image_settings(path, model.config)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
    return model.eval()


def _hub_name(key: str) -> str:
    for prefix, hub in VL_KEY_PREFIXES:
        if key.startswith(prefix):
            return hub + key[len(prefix):]
    return key


def _model_type(path: str) -> str:
    try:
        return model_type(path)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def model_from_config(config: ModelConfig,
                      device: torch.device | str = "cpu") -> tuple[ModelArchitecture, Tokenizer]:
    """The profile's model and tokenizer: the folder at ``config.path``, or (empty path) a
    seeded random-init model of ``config.size`` with the word-level tokenizer (with the
    vision tokens for ``tiny-vl``). A folder of another ``model_type`` than qwen2, qwen2_vl and
    qwen2_5_vl loads through transformers (:class:`tiderl.models.hf_causal.HFCausalLM`: the
    trainer runs it; engines: vLLM, SGLang)."""
    if config.path and _model_type(config.path) not in EMBEDDED_MODEL_TYPES:
        from tiderl.models.hf_causal import load_hf_causal

        return (load_hf_causal(config.path, DTYPES[config.dtype], device),
                load_tokenizer(config.path))
    if config.path:
        return load_model(config.path, config.dtype, device), load_tokenizer(config.path)
    from tiderl.models.random_init import init_model, is_vision_size
    from tiderl.models.tokenizer import with_vision_tokens, word_tokenizer

    model = init_model(config.size, config.seed)
    tokenizer = word_tokenizer()
    if is_vision_size(config.size):
        tokenizer = with_vision_tokens(tokenizer)
    return model.to(device=device, dtype=DTYPES[config.dtype]), tokenizer


def _empty_model(config: Qwen2Config, dtype: str | torch.dtype,
                 device: torch.device | str) -> ModelArchitecture:
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    architecture = Qwen2VLForCausalLM if isinstance(config, Qwen2VLConfig) else Qwen2ForCausalLM
    with torch.device("meta"):
        model = architecture(config)
    # Module.to_empty, with torch.empty: empty_like of a meta tensor runs a Python reference
    # that imports sympy (0.7 s of `tiderl engine serve`'s start-up)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model = model.to(torch_dtype)
    model.tie_weights()
    return model


def _check_keys(model: ModelArchitecture, state: dict) -> tuple[list[str], list[str]]:
    expected = set(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.discard(TIED_KEY)
    return sorted(expected - set(state)), sorted(set(state) - expected)
