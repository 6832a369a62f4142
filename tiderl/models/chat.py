"""Token ids of a multi-turn episode, built turn by turn and never re-encoded.

An episode's context is append-only: the opening (the environment's first messages) and, after
each generation, the model's output ids exactly as the engine sampled them, then the ids of the
messages that answer them. Re-encoding the whole conversation from text each turn would not give
the same ids: byte-level BPE merges across a turn boundary, and the text of sampled ids does not
always encode back to them. So only the *new* messages of a turn are encoded, and appended.

:class:`PlainEncoder` (a tokenizer without a chat template, like the word-level one): the
observation text as is, every turn. :class:`ChatEncoder` (an HF tokenizer with a chat template,
read with ``transformers.AutoTokenizer`` from local files): the opening is the template applied
to the first messages (and the tools) with the generation prompt; a later turn is what the
template adds for its new messages after a conversation that ends with an assistant turn
(rendered once for a two-message stand-in conversation and subtracted), preceded by what closes
the model's turn: the template's text after an assistant's content (``<|im_end|>\\n`` in ChatML),
less the eos the model sampled itself. The text of the ids built this way equals the template
applied to the whole conversation (``tests/unit/test_chat_encoding.py`` checks it over random
conversations); the loss covers the output ids only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from tiderl.env.agent_api import AgentModel

Message = dict[str, Any]  # OpenAI-style: role, content, tool_calls, tool_call_id, name
_SENTINEL = "\u2063END-OF-ASSISTANT\u2063"  # content no template or model writes


class TurnEncoder(Protocol):
    def opening(self, text: str, messages: Sequence[Message],
                tools: Sequence[dict[str, Any]]) -> list[int]:
        """The first prompt's ids."""

    def following(self, text: str, messages: Sequence[Message],
                  output_ids: Sequence[int]) -> list[int]:
        """The ids appended after ``output_ids`` (the turn just generated) for the answer."""

    def decode(self, output_ids: Sequence[int]) -> str:
        """The model's output as the environment reads it (special tokens dropped)."""


class PlainEncoder:
    """Observation text in, output text out, no template (the word-level tokenizer's way)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def opening(self, text: str, messages: Sequence[Message],
                tools: Sequence[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode(text).ids

    def following(self, text: str, messages: Sequence[Message],
                  output_ids: Sequence[int]) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, output_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(output_ids))


class ChatEncoder:
    """A chat template applied incrementally (see the module docstring). ``eos_ids``: the
    tokens that end a generation (the engine's eos set)."""

    def __init__(self, hf_tokenizer: Any, eos_ids: Sequence[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_ids = frozenset(eos_ids)
        stand_in = [{"role": "user", "content": "?"},
                    {"role": "assistant", "content": _SENTINEL}]
        self._stand_in = stand_in
        self._stand_in_text = self.render(stand_in, generation_prompt=False)
        at = self._stand_in_text.rfind(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template drops an assistant message's content")
        self.closing = self._stand_in_text[at + len(_SENTINEL):]  # after the model's content

    def render(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (), *,
               generation_prompt: bool = True) -> str:
        return self.hf.apply_chat_template(list(messages), tools=list(tools) or None,
                                           add_generation_prompt=generation_prompt,
                                           tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def opening(self, text: str, messages: Sequence[Message],
                tools: Sequence[dict[str, Any]]) -> list[int]:
        return self.encode(self.render(messages or _as_user(text), tools))

    def following(self, text: str, messages: Sequence[Message],
                  output_ids: Sequence[int]) -> list[int]:
        whole = self.render([*self._stand_in, *(messages or _as_user(text))])
        if not whole.startswith(self._stand_in_text):
            raise ValueError("the chat template rewrites earlier turns for these messages; "
                             "it cannot be applied turn by turn")
        return self.encode(self.close_after(output_ids) + whole[len(self._stand_in_text):])

    def close_after(self, output_ids: Sequence[int]) -> str:
        """The text that ends the model's turn after ``output_ids``: the template's closing,
        less the eos the model sampled when the closing starts with it."""
        if output_ids and output_ids[-1] in self.eos_ids:
            eos = self.hf.convert_ids_to_tokens(int(output_ids[-1]))
            if self.closing.startswith(eos):
                return self.closing[len(eos):]
        return self.closing

    def decode(self, output_ids: Sequence[int]) -> str:
        return self.hf.decode(list(output_ids), skip_special_tokens=True)


def _as_user(text: str) -> list[Message]:
    return [{"role": "user", "content": text}]


def has_chat_template(folder: str | Path) -> bool:
    """Whether the HF folder's tokenizer brings a chat template."""
    path = Path(folder)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def turn_encoder(folder: str | Path | None, tokenizer: Tokenizer, eos_ids: Sequence[int],
                 use_template: bool = True) -> TurnEncoder:
    """The folder's chat template (``transformers.AutoTokenizer``, local files only) when it has
    one and ``use_template``; else the plain tokenizer."""
    if folder is None or not use_template or not has_chat_template(folder):
        return PlainEncoder(tokenizer)
    from transformers import AutoTokenizer  # late: seconds to import, only where a template is

    return ChatEncoder(AutoTokenizer.from_pretrained(str(folder), local_files_only=True),
                       eos_ids)


class TokenCounter:
    """A conversation's prompt tokens under the model's chat template (or its plain text),
    the tokenizer loaded on the first count."""

    def __init__(self, path: str, use_template: bool = True) -> None:
        self.path, self.use_template = path, use_template
        self.encoder: Any = None

    def __call__(self, messages: list[dict], tools: list[dict]) -> int:
        if self.encoder is None:
            from tiderl.models.folder import load_tokenizer
            from tiderl.models.tokenizer import word_tokenizer

            tokenizer = load_tokenizer(self.path) if self.path else word_tokenizer()
            self.encoder = turn_encoder(self.path or None, tokenizer, (), self.use_template)
        text = "\n".join(str(m.get("content", "")) for m in messages)
        return len(self.encoder.opening(text, messages, tools))


def agent_model(path: str, size: str, kv_cache_tokens: int, use_template: bool = True
                ) -> AgentModel:
    """How the agent endpoint (:mod:`tiderl.env.agent_api`) describes a job's model: the
    folder's name (or the seeded size), its context length (the rank's bound: the KV cache,
    and the folder's own limit), its prompts' token counts."""
    from tiderl.env.agent_api import AgentModel
    from tiderl.models.config import context_length

    limit = (context_length(path) if path else None) or kv_cache_tokens
    return AgentModel(Path(path).name if path else size, min(limit, kv_cache_tokens),
                      TokenCounter(path, use_template), str(Path(path).resolve()) if path else "")
