"""Any ``transformers`` causal LM behind the forward the trainer calls.

The trainer's backends (:mod:`tiderl.trainer.parallel`) call their model as
:class:`tiderl.models.qwen2.Qwen2ForCausalLM` is called: dense (``input_ids [B, T]`` → logits) or
packed (sequences back to back with ``cu_seqlens``; with ``targets`` and ``target_rows``, the
log-probability of each target, the lm_head run over those rows only, a chunk at a time, each
chunk recomputed in backward). :class:`HFCausalLM` gives an ``AutoModelForCausalLM`` of any
architecture that forward: a packed batch runs right-padded with an attention mask (the model's
own attention; no varlen kernel), and the lm_head part is Qwen2's.

Its parameters keep the HF names (``model.layers.0...``, ``lm_head.weight``): the submodules are
the HF model's own, so weights sync, checkpoint and export as the HF folder names them.

A job whose ``model.path`` has another ``model_type`` than qwen2 trains it this way
(:func:`tiderl.models.loading.model_from_config`) with vLLM or SGLang rolling out: the embedded
engine and ``tiderl engine serve`` run Qwen2 only (``tiderl launch`` says so in one line).
:class:`HFModelConfig` is what the job reads of its config; the folders it writes from the
weights carry the folder's own config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiderl.models.folder import joined_eos
from tiderl.models.qwen2 import chunked_target_logprobs


@dataclass(frozen=True)
class HFModelConfig:
    """What the job reads of a model's config (as of a :class:`Qwen2Config`), for a folder of
    another architecture: ``to_hf`` is its own config.json, so the folders the job writes from
    its weights name the same architecture."""

    hf: dict[str, Any]
    eos_token_id: int | tuple[int, ...] | None

    @property
    def vocab_size(self) -> int:
        return int(self.hf["vocab_size"])

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf.get("max_position_embeddings") or 2048)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.hf.get("tie_word_embeddings", False))

    def to_hf(self) -> dict[str, Any]:
        return dict(self.hf)


class HFCausalLM(nn.Module):
    def __init__(self, hf_model: Any, eos_token_id: int | tuple[int, ...] | None = None
                 ) -> None:
        super().__init__()
        prefix = getattr(hf_model, "base_model_prefix", "")
        base = getattr(hf_model, prefix, None) if prefix else None
        head = hf_model.get_output_embeddings() if base is not None else None
        if head is None:
            raise ValueError(f"{type(hf_model).__name__}: not a causal LM with a base model "
                             "and an output embedding")
        self.config = HFModelConfig(hf_model.config.to_dict(), eos_token_id)
        # the HF model's own submodules, under its own names: state_dict keys are the folder's
        setattr(self, prefix, base)
        self.base_name = prefix
        self.lm_head = head

    @property
    def base(self) -> nn.Module:
        return getattr(self, self.base_name)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def enable_activation_checkpointing(self) -> None:
        """Each decoder layer recomputed in backward (transformers' own checkpointing)."""
        enable = getattr(self.base, "activation_checkpointing_enable", None)  # transformers 5.x
        if enable is None:  # 4.x
            enable = self.base.gradient_checkpointing_enable
        enable({"use_reentrant": False})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                cu_seqlens: list[int] | None = None, targets: torch.Tensor | None = None,
                target_rows: torch.Tensor | None = None,
                chunk_tokens: int = 1024) -> torch.Tensor:
        """As :meth:`Qwen2ForCausalLM.forward` (positions from 0 in each sequence)."""
        if cu_seqlens is None:
            return self.lm_head(self.base(input_ids=input_ids, position_ids=positions,
                                          use_cache=False).last_hidden_state)
        hidden = self._packed_hidden(input_ids, cu_seqlens)
        if targets is None or target_rows is None:
            return self.lm_head(hidden)
        return chunked_target_logprobs(self.lm_head, hidden[target_rows], targets, chunk_tokens)

    def _packed_hidden(self, input_ids: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """[N, hidden] for packed rows: each sequence right-padded to the longest, masked."""
        lengths = [b - a for a, b in pairwise(cu_seqlens)]
        width = max(lengths)
        padded = input_ids.new_zeros(len(lengths), width)
        mask = torch.zeros(len(lengths), width, dtype=torch.bool, device=input_ids.device)
        for row, (start, length) in enumerate(zip(cu_seqlens, lengths, strict=False)):
            padded[row, :length] = input_ids[start:start + length]
            mask[row, :length] = True
        hidden = self.base(input_ids=padded, attention_mask=mask.long(),
                           use_cache=False).last_hidden_state
        return hidden[mask]  # row-major: the packed order



def load_hf_causal(path: str | Path, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> HFCausalLM:
    """The folder's ``AutoModelForCausalLM`` (local files only), wrapped."""
    from transformers import AutoModelForCausalLM  # late: seconds to import
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a rank's log is its own
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    return HFCausalLM(model.to(device),
                      joined_eos(model.config.to_dict().get("eos_token_id"), Path(path)))
