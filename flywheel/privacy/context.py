"""How context words near a match raise its score: whole words, plurals allowed.

Presidio's `LemmaContextAwareEnhancer` looks at the five words before each match (and the match's
own first token) and, if one of them is a context word of the recognizer, adds 0.35 to the score
(at least 0.4). By default a context word counts when it is a *substring* of a nearby word, which
in chat and code traffic fires all the time: "lic" (driver licence) is in "public", "policy",
"replica" and "duplicate", "us" (US passport) in "using", "status" and "focus", "pan" (Indian
PAN) in "pandas" and "expand". Presidio's own "whole_word" mode needs a lemmatizer for plurals,
and this detector has none (`flywheel.privacy.nlp`), so here a context word counts when a nearby
word is that word or its plural ("numbers", "passports", "addresses"). A context phrase ("tax file
number", "Thai ID Number", "kimlik no") or a word with punctuation ("steuer-id", "ssn#") counts
when each of its words, stop words aside, is among the nearby words; in either Presidio mode such
entries never matched, since they are compared with one word at a time, which left recognizers
whose context is only phrases (Thai and Turkish ids) without context.

The enhancer also finds the token under a match by bisection instead of walking every token of
the text once per candidate match, and changes the candidates in place instead of deep-copying
them first.
"""

from __future__ import annotations

import functools
import re
from bisect import bisect_right

from presidio_analyzer.context_aware_enhancers import LemmaContextAwareEnhancer
from spacy.lang.en.stop_words import STOP_WORDS


def word_forms(word: str) -> tuple[str, ...]:
    """`word` and the singular forms it could be the plural of."""
    if len(word) > 3 and word.endswith("es"):
        return word, word[:-1], word[:-2]
    if len(word) > 2 and word.endswith("s"):
        return word, word[:-1]
    return (word,)


@functools.lru_cache(maxsize=4096)
def phrase_words(context_word: str) -> tuple[str, ...]:
    """The words of a context word or phrase, lower-cased, without stop words."""
    words = tuple(w for w in re.findall(r"\w+", context_word.lower()) if w not in STOP_WORDS)
    return words or tuple(re.findall(r"\w+", context_word.lower()))


class _Owned(list):
    """Results the enhancer may change in place: `deepcopy` gives the list itself."""

    def __deepcopy__(self, memo):
        return self


class WholeWordContext(LemmaContextAwareEnhancer):
    def enhance_using_context(self, text, raw_results, nlp_artifacts, recognizers, context=None):
        # Presidio deep-copies every candidate (with its explanation) before raising scores; the
        # analyzer makes them for this call and never looks at them again, so they are changed in
        # place instead (a fifth of the detector's time on log and JSON text).
        return super().enhance_using_context(text, _Owned(raw_results), nlp_artifacts, recognizers, context)

    @staticmethod
    def _find_supportive_word_in_context(context_list, recognizer_context_list, matching_mode=None) -> str:
        if not context_list or not recognizer_context_list:
            return ""
        nearby = {form for word in context_list for form in word_forms(word.lower())}
        for context_word in recognizer_context_list:
            words = phrase_words(context_word)
            if words and all(w in nearby for w in words):
                return context_word
        return ""

    @staticmethod
    def _find_index_of_match_token(word, start, tokens, tokens_indices) -> int:
        ends = getattr(tokens, "ends", None)
        if ends is None:
            return LemmaContextAwareEnhancer._find_index_of_match_token(word, start, tokens, tokens_indices)
        i = bisect_right(ends, start)  # the first token that ends after `start`
        if i == len(ends):
            raise ValueError(f"no token at offset {start} for {word!r}")
        return i
