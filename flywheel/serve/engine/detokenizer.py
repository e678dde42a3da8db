"""Incremental detokenization: the text each new token adds, at a cost bounded by a few tokens
rather than by the output so far.

Decoding a token alone can be wrong: a SentencePiece token drops its leading space when it
starts the text, and a byte-level BPE token may hold part of a UTF-8 character. So each call
decodes a short window twice, from the last settled token (`prefix`) to the previous end
(`read`) and to the new end, and returns the difference; while that ends in an incomplete
character (U+FFFD) nothing is returned and the window grows until it completes.
"""

from __future__ import annotations

from typing import Any

INCOMPLETE = "\ufffd"


def decoder(tokenizer: Any, skip_special: bool) -> Any:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=skip_special)`; straight to the Rust
    tokenizer when that is all transformers' decode would do (a fast tokenizer without the
    clean-up pass), which skips a few microseconds of Python per call on the per-token path."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep the public call
        TokenizersBackend = PreTrainedTokenizerBase = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (TokenizersBackend is not None and backend is not None and not tokenizer.clean_up_tokenization_spaces
            and getattr(type(tokenizer), "_decode", None) is TokenizersBackend._decode
            and getattr(type(tokenizer), "decode", None) is PreTrainedTokenizerBase.decode):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special)


class IncrementalText:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self._decode = decoder(tokenizer, skip_special_tokens)
        self.prefix = 0
        self.read = 0

    def added(self, ids: list[int]) -> str:
        """The text that `ids` (the whole output so far, one or more tokens longer than at the
        last call) adds to what earlier calls returned."""
        before = self._decode(ids[self.prefix:self.read])
        after = self._decode(ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(INCOMPLETE):
            return ""
        self.prefix, self.read = self.read, len(ids)
        return after[len(before):]
