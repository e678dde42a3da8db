"""How far a practice reply does what a person's corrections ask, for the aspects a rule can
check (`judge.teacher.practice_reward: checks`).

Practice (flywheel/judge/practice.py) samples several replies to a corrected request; told the
hint, the teacher moves each toward what it would write, so the adapter learns at most what the
teacher does (docs/experiments/learning-from-use.md, section 4). Some aspects the wish reader
finds (flywheel/judge/wishes.py) are properties of the reply's form that a rule sees without
a model: how long it is, whether it lists, how formal it is, whether it names the person.
For those, each reply gets a score, and the group's rewards are those scores: normalised within
the group, the replies that do more of what was asked get a positive advantage and the others
a negative one, whether or not the teacher would have written them (the verifiable-constraint
rewards of RLVR, Tülu 3's instruction-following checks, applied to what the person asked for).

A score ranks replies to one request against each other; it is not a pass mark. Lengths are
compared as log word counts, so halving a reply counts the same whether it was 80 words or 40.
An aspect without a rule (a plain-words, an example, a language wish, `other`) scores nothing,
and a turn whose wishes have none leaves the group's rewards equal: the teacher alone teaches it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
_LIST_LINE = re.compile(r"^\s*(?:[-*•+]|\d{1,2}[.)])\s+\S", re.MULTILINE)
_MARKUP = re.compile(r"^\s*#{1,6}\s|\*\*|__|`|^\s*>", re.MULTILINE)
_CONTRACTION = re.compile(r"\b\w+['’](?:s|t|re|ve|ll|d|m)\b", re.IGNORECASE)
_SENTENCE_BREAK = re.compile(r"(?<=[.!?:])\s+|\n+")
_POSSESSIVE = re.compile(r"['’]s$")


def _bare(word: str) -> str:
    return _POSSESSIVE.sub("", word)


def _length(text: str) -> float:
    return math.log1p(len(_WORD.findall(text)))


def _list_lines(text: str) -> int:
    return len(_LIST_LINE.findall(text))


def _informality(text: str) -> int:
    return len(_CONTRACTION.findall(text)) + text.count("!")


def names_in(messages: list[dict[str, Any]]) -> set[str]:
    """Proper names the conversation gives: capitalised words its system and user messages use
    inside a sentence ("You are Maya's personal assistant.", "I'm Maya, by the way")."""
    found = set()
    for message in messages:
        if message.get("role") in ("system", "user") and isinstance(message.get("content"), str):
            for sentence in _SENTENCE_BREAK.split(message["content"]):
                for word in map(_bare, _WORD.findall(sentence)[1:]):
                    if word.isalpha() and word[0].isupper() and word[1:].islower():
                        found.add(word)
    return found


def _named(text: str, messages: list[dict[str, Any]]) -> float:
    """1 for a reply that opens with a name the conversation gives, 0.5 for one that uses it later."""
    said = [_bare(w) for w in _WORD.findall(text)]
    names = names_in(messages)
    return 1.0 if said[:1] and said[0] in names else 0.5 if names & set(said) else 0.0


CHECKS: dict[str, Callable[[str, list[dict[str, Any]]], float]] = {
    "shorter": lambda text, _: -_length(text),
    "longer": lambda text, _: _length(text),
    "list": lambda text, _: min(_list_lines(text), 3),
    "prose": lambda text, _: -(_list_lines(text) + len(_MARKUP.findall(text))),
    "formal": lambda text, _: -_informality(text),
    "name": _named,
}
"""Each checkable aspect's score of a reply (its text, the conversation before it): higher is more
of what the aspect asks."""


def score(aspects: list[str], text: str, messages: list[dict[str, Any]]) -> float | None:
    """The reply's score for the aspects asked (their sum); None when none of them has a check."""
    checked = [CHECKS[aspect](text, messages) for aspect in aspects if aspect in CHECKS]
    return float(sum(checked)) if checked else None
