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


class IncrementalText:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix = 0
        self.read = 0

    def added(self, ids: list[int]) -> str:
        """The text that `ids` (the whole output so far, one or more tokens longer than at the
        last call) adds to what earlier calls returned."""
        decode = self.tokenizer.decode
        before = decode(ids[self.prefix:self.read], skip_special_tokens=self.skip_special_tokens)
        after = decode(ids[self.prefix:], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith(INCOMPLETE):
            return ""
        self.prefix, self.read = self.read, len(ids)
        return after[len(before):]
