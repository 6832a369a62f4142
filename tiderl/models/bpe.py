"""A byte-level BPE tokenizer with a ChatML chat template, trained here on the built-in
environments' text, for random-init models that play any text environment.

The word-level tokenizer (:mod:`tiderl.models.tokenizer`) maps every word outside its list to
``<unk>``; a byte-level BPE encodes any text. :func:`train_bpe` learns ``vocab_size`` tokens from
episodes of the built-in environments played by their scripted solvers (and their observations,
so the model meets the words it will see); :func:`write_tokenizer_files` writes the folder's
tokenizer files the way transformers reads them:

    tokenizer.json          the BPE (byte-level pre-tokenizer and decoder)
    tokenizer_config.json   special tokens, ``tokenizer_class``, the chat template
    generation_config.json  the eos set (``<|im_end|>`` ends a turn, ``<|endoftext|>`` a text)

The chat template is ChatML with tools in the Hermes format (the Qwen2.5 family's): a
``system`` message lists the tools in ``<tools>``; an assistant calls one with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``tool`` messages come back inside
``<tool_response>`` in a user turn. ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` are
special; the tool tags are added (whole) tokens that decoding keeps, so an environment reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
BPE_VOCAB_SIZE = 2048
EPISODES_PER_ENV = 64  # of each built-in environment, scripted: a few hundred KB of text

CHAT_TEMPLATE = """\
{%- macro render(content) %}
{%- if content is string or content is none %}{{- content or '' }}
{%- else %}{%- for part in content %}
{%- if part.type == 'text' %}{{- part.text }}
{%- else %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}
{%- endfor %}{%- endif %}
{%- endmacro %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- render(messages[0].content) + '\\n\\n' }}{%- endif %}
{{- 'You may call functions. Their signatures are in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall one as <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>' }}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + render(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + render(message.content) + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + render(message.content) }}
{%- for call in (message.tool_calls or []) %}
{%- set fn = call.function if call.function is defined else call %}
{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + args + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def corpus(episodes_per_env: int = EPISODES_PER_ENV) -> Iterator[str]:
    """Observations and scripted actions of the built-in environments, and the chat template's
    own words: the text a model trained here reads and writes."""
    from tiderl.env.base import observation_text
    from tiderl.env.registry import ENV_NAMES, make_env

    for name in ENV_NAMES:
        for seed in range(episodes_per_env):
            env = make_env(name)
            observation, _ = env.reset(None, seed)
            yield observation_text(observation)
            for _ in range(env.max_turns):
                try:
                    action = env.solve()
                except NotImplementedError:
                    break
                yield action
                result = env.step(action)
                yield observation_text(result.observation)
                if result.done:
                    break
    yield CHAT_TEMPLATE


def train_bpe(vocab_size: int = BPE_VOCAB_SIZE, texts: Iterator[str] | None = None
              ) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (specials first: ids 0, 1, 2), trained on
    ``texts`` (default :func:`corpus`). The same texts give the same tokenizer."""
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts if texts is not None else corpus(), trainer)
    tokenizer.add_tokens(list(TOOL_TAGS))
    return tokenizer


def write_tokenizer_files(tokenizer: Tokenizer, folder: str | Path) -> list[Path]:
    """tokenizer.json, tokenizer_config.json (with the chat template) and
    generation_config.json for ``tokenizer`` (from :func:`train_bpe`) in ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    added = {str(ids[t]): _added(t, special=True) for t in SPECIAL_TOKENS}
    added |= {str(tokenizer.token_to_id(t)): _added(t, special=False) for t in TOOL_TAGS}
    files = {
        "tokenizer.json": None,
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
            "bos_token": None, "eos_token": IM_END, "pad_token": ENDOFTEXT,
            "unk_token": None, "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE},
        "generation_config.json": {
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT]},
    }
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    for name, content in files.items():
        if content is not None:
            (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return [out / name for name in files]


def _added(token: str, *, special: bool) -> dict:
    return {"content": token, "special": special, "lstrip": False, "rstrip": False,
            "normalized": False, "single_word": False}
