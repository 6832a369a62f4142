"""The files of an HF-format model folder: ``config.json`` + ``model.safetensors`` (or shards
listed in ``model.safetensors.index.json``) + ``tokenizer.json``, and where the folder has them
the files transformers and the engines read beside it: ``tokenizer_config.json`` (special
tokens, the chat template), ``chat_template.jinja``, ``special_tokens_map.json`` and
``generation_config.json`` (its ``eos_token_id`` joins config.json's: the eos set ends a
generation), and for a vision model ``preprocessor_config.json`` and ``chat_template.json`` (the
processor's).

This module reads and writes those files: the weights by HF name, the eos set, the tokenizer.
Which model a folder holds (Qwen2, Qwen2-VL, any other transformers causal LM) is decided above
it, by :mod:`tiderl.models.loading`; the random-init checkpoints
(:mod:`tiderl.models.random_init`) and the transformers wrapper (:mod:`tiderl.models.hf_causal`)
write and read through it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from tiderl.core.quote import short
from tiderl.models.qwen2 import DTYPES, Qwen2Config, Qwen2ForCausalLM
from tiderl.models.qwen2_vl import Qwen2VLForCausalLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_EXTRAS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                    GENERATION_CONFIG_FILE, "preprocessor_config.json", "chat_template.json")
TIED_KEY = "lm_head.weight"

ModelArchitecture = Qwen2ForCausalLM | Qwen2VLForCausalLM  # the models this package builds


class ModelLoadError(Exception):
    """A model folder that cannot be read; the message names the file."""


def joined_eos(eos: object, folder: Path) -> int | tuple[int, ...] | None:
    """config.json's eos (``eos``) with generation_config.json's: one id, several, or none."""
    ids = tuple(dict.fromkeys(_ids(eos) + _generation_eos(folder)))
    return ids[0] if len(ids) == 1 else (ids or None)


def _generation_eos(folder: Path) -> tuple[int, ...]:
    file = folder / GENERATION_CONFIG_FILE
    if not file.is_file():
        return ()
    try:
        return _ids(json.loads(file.read_text()).get("eos_token_id"))
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{file}: {exc}") from exc


def _ids(value: object) -> tuple[int, ...]:
    """An HF token-id field (none, an int or a list of ints) as a tuple."""
    if value is None:
        return ()
    ids = (value,) if isinstance(value, int) else tuple(value)  # type: ignore[arg-type]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_id: expected token ids, got {short(value)}")
    return ids


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s), by HF name."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: {exc!r}") from None
    elif (folder / WEIGHTS_FILE).exists():
        files = [WEIGHTS_FILE]
    else:
        raise ModelLoadError(f"{folder}: no {WEIGHTS_FILE} or {INDEX_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[key] = handle.get_tensor(key)
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"{folder / name}: {exc}") from None
    return tensors


def save_model(model: ModelArchitecture, path: str | Path,
               max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights (one file, or shards of at most
    ``max_shard_bytes`` plus an index). Tied models omit ``lm_head.weight``, as HF does."""
    save_state_dict(model.state_dict(), model.config, path, max_shard_bytes)


def save_state_dict(state: dict[str, torch.Tensor], config: Qwen2Config, path: str | Path,
                    max_shard_bytes: int | None = None) -> None:
    """``save_model`` for the weights alone (HF names), as a weight sync delivers them; the
    config's ``torch_dtype`` is the weights' dtype."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop(TIED_KEY, None)
    dtype = next(iter(state.values())).dtype
    hf = config.to_hf() | {"torch_dtype": _dtype_name(dtype)}
    (folder / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        _save_weights(shards[0], folder / WEIGHTS_FILE, folder / CONFIG_FILE)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_weights(shard, folder / name, folder / CONFIG_FILE)
        weight_map |= dict.fromkeys(shard, name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _save_weights(tensors: dict[str, torch.Tensor], file: Path, like: Path) -> None:
    """``save_file``, then the permissions of ``like`` (config.json, written just before): the
    safetensors library writes through a private temporary file (mode 0600) that it renames, so
    its files would not get the umask's mode as every other file of the folder does."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    file.chmod(like.stat().st_mode & 0o777)


def _shards(state: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict]:
    shards: list[dict] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def copy_tokenizer_extras(source: str | Path | None, folder: str | Path) -> None:
    """The ``TOKENIZER_EXTRAS`` of the HF folder ``source`` (those it has) into ``folder``, so
    that a folder written from its weights reads like the original (template, eos set)."""
    if not source:
        return
    for name in TOKENIZER_EXTRAS:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(folder) / name)


def load_tokenizer(path: str | Path) -> Tokenizer:
    file = Path(path) / TOKENIZER_FILE
    if not file.exists():
        raise ModelLoadError(f"{file}: not found")
    return Tokenizer.from_file(str(file))
