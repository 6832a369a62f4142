"""Model section of a profile."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tiderl.core.config import require_choice

MODEL_SIZES = ("tiny", "small", "tiny-vl")  # tiny-vl: a Qwen2-VL (tiderl.models.random_init)
TOKENIZER_KINDS = ("word", "bpe")  # of `tiderl model init --tokenizer`
DTYPES = ("float32", "bfloat16")
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # config.json model_type of a Qwen2-VL folder
# what this package builds itself (engine, trainer); a folder of another type loads via
# transformers and rolls out on vLLM or SGLang
EMBEDDED_MODEL_TYPES = ("qwen2", *VL_MODEL_TYPES)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights the engine and the trainer load.

    ``path`` is an HF-format folder (config.json, *.safetensors, tokenizer.json) or a hub id
    (``Qwen/Qwen2.5-7B-Instruct``: resolved at launch with huggingface_hub, ``tiderl.models.hub``,
    at ``revision``, a branch, tag or commit; the launch pins the commit it got); empty means a
    seeded random-init model of ``size`` made locally (no downloads; ``tiny-vl``: a Qwen2-VL
    whose word-level tokenizer has the vision tokens). ``chat_template``: apply
    the folder's chat template to the environment's messages when it has one (else, and for
    ``false``, the observation text is encoded as is).
    """

    path: str = ""
    revision: str = ""  # of a hub id (empty: main)
    size: str = "tiny"
    seed: int = 0
    dtype: str = "float32"
    chat_template: bool = True

    def __post_init__(self) -> None:
        require_choice(self.size, MODEL_SIZES, "size")
        require_choice(self.dtype, DTYPES, "dtype")


def model_type(path: str | Path) -> str:
    """The HF folder's ``config.json`` ``model_type`` (``qwen2`` when it names none); a
    ValueError naming the file when it cannot be read."""
    file = Path(path) / "config.json"
    try:
        return str(json.loads(file.read_text()).get("model_type") or "qwen2")
    except FileNotFoundError:
        raise ValueError(f"{file}: not found") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{file}: {exc}") from None


def context_length(path: str | Path) -> int | None:
    """The HF folder's context length (``max_position_embeddings``, a VL model's in its
    ``text_config``); None when its ``config.json`` cannot be read or names none (a folder on
    another node)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        value = config.get("max_position_embeddings",
                           (config.get("text_config") or {}).get("max_position_embeddings"))
        return int(value) if value else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None
