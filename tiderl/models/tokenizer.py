"""The word-level tokenizer of random-init models (one token per word of :mod:`.vocab`).

Text is lower-cased, split on whitespace, and every punctuation mark becomes its own token;
words outside the list map to ``<unk>``. Decoding joins tokens with single spaces. Real
checkpoints bring their own ``tokenizer.json`` (see :func:`tiderl.models.folder.load_tokenizer`).
"""

from __future__ import annotations

from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordLevel

from tiderl.models.vocab import SPECIALS, UNK, VISION_TOKENS, VOCAB


def word_tokenizer() -> Tokenizer:
    """The tokenizer over :data:`tiderl.models.vocab.VOCAB` (ids are list positions)."""
    tokenizer = Tokenizer(WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Punctuation(behavior="isolated"),
    ])
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer


def with_vision_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` (changed in place) with :data:`~tiderl.models.vocab.VISION_TOKENS` added
    as special tokens after its vocabulary: ids ``n``, ``n + 1``, ``n + 2`` for a vocabulary
    of ``n``."""
    tokenizer.add_special_tokens(list(VISION_TOKENS))
    return tokenizer
