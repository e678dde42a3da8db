"""The NLP engine under the detector: a regular-expression tokenizer, no spaCy model at all.

Presidio's own engines load a trained spaCy model (`en_core_web_lg` by default) and call
`spacy.cli.download` when it is missing; trained models are not on PyPI and the detector must run
with no network. The pattern recognizers need only one thing from the NLP engine: the words around
a match, which the context enhancer compares with each recognizer's context words ("ssn",
"passport", "phone"...). Only `LemmaContextAwareEnhancer` reads the artifacts, and only `tokens`
(their lengths), `tokens_indices`, `lemmas` and `keywords`.

So this engine splits text into words and single punctuation characters with one regular
expression and gives the lower-cased word as its "lemma" (context words match as substrings by
default, so "number" still finds "numbers"); stop words are spaCy's English list. It replaces a
blank spaCy pipeline (`spacy.blank("en")`), which would work too but costs twice over in a
long-running gateway: its vocabulary keeps every distinct token it has ever seen (measured: about
500 bytes each, 100 MB per 200,000 distinct ids or hashes, never freed), and the enhancer walks
the spaCy `Doc` once per candidate match, building a Python `Token` object per word each time
(a fifth of the detector's time on 2 kB texts). Tokens here are plain strings.

There is no named-entity recognition: names, places and organisations are not found.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Iterator

from presidio_analyzer.nlp_engine import NlpArtifacts, NlpEngine
from spacy.lang.en.stop_words import STOP_WORDS

TOKEN = re.compile(r"\w+|[^\w\s]")


class Tokens(list):
    """The tokens of a text (strings) and, in `ends`, where each ends (for bisection)."""

    ends: list[int]


def tokenize(text: str) -> tuple[Tokens, list[int]]:
    """Words (runs of letters, digits, `_`) and single other non-space characters, with offsets."""
    tokens, starts, ends = Tokens(), [], []
    for m in TOKEN.finditer(text):
        tokens.append(m.group())
        starts.append(m.start())
        ends.append(m.end())
    tokens.ends = ends
    return tokens, starts


class RegexNlpEngine(NlpEngine):
    """Tokens, lower-cased words as lemmas, English stop words; no entities, no model."""

    engine_name = "flywheel_regex"
    is_available = True

    def __init__(self, languages: Iterable[str] = ("en",)):
        self.languages = list(languages)
        self._loaded = False

    def load(self) -> None:
        self._loaded = True

    def is_loaded(self) -> bool:
        return self._loaded

    def process_text(self, text: str, language: str) -> NlpArtifacts:
        self._check(language)
        tokens, starts = tokenize(text)
        lemmas = [t.lower() for t in tokens]
        artifacts = NlpArtifacts(entities=[], tokens=tokens, tokens_indices=starts, lemmas=lemmas,
                                 nlp_engine=None, language=language, scores=[])  # no engine: no keywords yet
        artifacts.nlp_engine = self
        # Presidio's keywords are the lemmas that are neither stop words nor punctuation ("-PRON-"
        # and "be" aside), split at ":" (never inside these tokens). The enhancer only asks
        # whether a word is among them, once per word it looks at for every candidate match: a
        # list (Presidio's) made that quadratic in the text's length (0.3 s of 0.9 s on a 20 kB
        # tool output); a set of the distinct words makes it constant, and cheaper to build.
        artifacts.keywords = frozenset(
            w for w in set(lemmas)
            if w not in STOP_WORDS and not self.is_punct(w, language) and w not in ("-pron-", "be")
        )
        return artifacts

    def process_batch(self, texts, language: str, batch_size: int = 1, n_process: int = 1,
                      as_tuples: bool = False, **kwargs) -> Iterator:
        for item in texts:
            if as_tuples:
                text, context = item
                yield str(text), self.process_text(str(text), language), context
            else:
                yield str(item), self.process_text(str(item), language)

    def is_stopword(self, word: str, language: str) -> bool:
        return word.lower() in STOP_WORDS

    def is_punct(self, word: str, language: str) -> bool:
        return bool(word) and all(unicodedata.category(c).startswith("P") for c in word)

    def get_supported_entities(self) -> list[str]:
        return []  # no NER

    def get_supported_languages(self) -> list[str]:
        return list(self.languages)

    def _check(self, language: str) -> None:
        if not self._loaded:
            raise ValueError("NLP engine is not loaded; call load() first")
        if language not in self.languages:
            raise ValueError(f"language {language!r} not supported (have {self.languages})")
