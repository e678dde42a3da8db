"""How far each of a group of practice replies does what a person's corrections ask, for the
aspects a rule can check (`judge.teacher.practice_reward: checks`).

Practice (flywheel/judge/practice.py) samples several replies to a corrected request; told the
hint, the teacher moves each toward what it would write, so the adapter learns at most what the
teacher does (docs/experiments/learning-from-use.md, section 4). Some aspects the wish reader
finds (flywheel/judge/wishes.py) are properties of the reply's form that a rule sees without
a model: how long it is, whether it lists, how formal it is, whether it names the person.
For those, the group's rewards rank its replies by how much of the aspect each does, and the
replies that do more get a positive advantage whether or not the teacher would have written
them (the verifiable-constraint rewards of RLVR, Tülu 3's instruction-following checks,
applied to what the person asked for). The gateway's best of k (`best`, flywheel/serve/best_of.py)
serves the reply the same checks rank first, with the judge's reading of each reply at hand.

A score ranks replies to one request against each other; it is not a pass mark. Length is the
log of the reply's characters other than spaces (halving a reply counts the same at 400 or 40,
and a language written without spaces is measured as well as one with them). Each aspect's
scores are standardised within the group and summed, so no aspect outweighs another by its
scale, and the rewards are centred. A reply without a word, or one that does not answer the
request (the base model's view, flywheel/judge/relevance.py), ranks last, below every reply
that answers, whatever its form: the practice does not learn to stop answering. The aspects
rank nothing (the answers alone may) where one asked has no rule (plain words, an example, a
language, `other`: a wish half checked would reward dropping the other half) or two asked are
opposites; no rewards at all (the group stays equal, the teacher alone teaching it) where no
reply answers or the replies do not differ in what is checked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from statistics import fmean, pstdev
from typing import Any

from flywheel.bus.instructions import names_in

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
_LIST_LINE = re.compile(r"^\s*(?:[-*•+]|\d{1,2}[.)])\s+\S", re.MULTILINE)
_MARKUP = re.compile(r"^\s*#{1,6}\s|\*\*|__|`|^\s*>", re.MULTILINE)
_CONTRACTION = re.compile(r"\w(?:n['’]t|['’](?:re|ve|ll|d|m))\b|\b(?:it|that|there|here|what|who|where|he|she|let)['’]s\b",
                          re.IGNORECASE)
_GREETINGS = {"dear", "hi", "hello", "hey"}


def characters(text: str) -> int:
    """The reply's characters other than spaces (a language written without them counts alike)."""
    return sum(not c.isspace() for c in text)


def _length(text: str) -> float:
    return math.log1p(characters(text))


def _list_lines(text: str) -> int:
    return len(_LIST_LINE.findall(text))


def _named(text: str, names: set[str]) -> float:
    """1 for a reply that opens by addressing the person (one of their names first, or after a
    greeting: "Dear Maya,"), 0.5 for one that uses a name later."""
    said = _WORD.findall(text)
    opening = said[1:2] if said[:1] and said[0].lower() in _GREETINGS else said[:1]
    return 1.0 if set(opening) & names else 0.5 if names & set(said) else 0.0


CHECKS: dict[str, Callable[[str, set[str]], float]] = {
    "shorter": lambda text, _: -_length(text),
    "longer": lambda text, _: _length(text),
    "list": lambda text, _: min(_list_lines(text), 3),
    "prose": lambda text, _: -(_list_lines(text) + len(_MARKUP.findall(text))),
    "formal": lambda text, _: -(len(_CONTRACTION.findall(text)) + text.count("!")),
    "name": _named,
}
"""Each checkable aspect's score of a reply (its text, the names the person goes by): higher is
more of what the aspect asks."""
OPPOSITES = ({"shorter", "longer"}, {"list", "prose"})
ANSWERS_AT = 0.5
"""`best`: the least share of what the reply of k that says the most about the request says that
another must say to be read as answering it (the adapter guard's mark for its replies against
its reference's, flywheel/train/adapter_guard.py)."""


def checkable(aspects: list[str]) -> bool:
    """Whether a rule checks every aspect asked, and none asks the opposite of another."""
    return bool(aspects) and all(a in CHECKS for a in aspects) and not any(pair <= set(aspects) for pair in OPPOSITES)


def _standardised(aspects: list[str], score: Callable[[str], list[float]], size: int) -> list[float]:
    """Each checked aspect's scores of a group's replies (`score`), standardised within the group and
    summed (nothing where the aspects are not `checkable`)."""
    total = [0.0] * size
    for aspect in aspects if checkable(aspects) else []:
        scores = score(aspect)
        mean, spread = fmean(scores), pstdev(scores)
        if spread > 0:
            total = [t + (s - mean) / spread for t, s in zip(total, scores)]
    return total


def rewards(aspects: list[str], replies: list[str], messages: list[dict[str, Any]],
            answered: list[bool] | None = None) -> list[float] | None:
    """The rewards of a group of replies to one request for what `aspects` ask (see the module),
    those that do not answer it (`answered`: flywheel/judge/relevance.py) or say no word ranking
    last; None where they cannot say or do not differ."""
    answering = [bool(_WORD.search(text)) and (answered is None or answered[j]) for j, text in enumerate(replies)]
    if not any(answering):
        return None
    names = set(names_in(messages))
    total = _standardised(aspects, lambda aspect: [CHECKS[aspect](text, names) for text in replies], len(replies))
    if not all(answering):
        last = min(t for t, a in zip(total, answering) if a) - 1.0
        total = [t if a else last for t, a in zip(total, answering)]
    if max(total) - min(total) < 1e-9:
        return None
    mean = fmean(total)
    return [t - mean for t in total]


def best(aspects: list[str], replies: list[str], messages: list[dict[str, Any]], gains: list[float]) -> int | None:
    """Of k replies to one request, the index of the one to serve (`memory.best_of`,
    flywheel/serve/best_of.py), given what the judge reads of each: `gains`, the reply's pointwise
    information about the request in nats (flywheel/judge/relevance.py), what it says about the
    request. For `shorter` what a reply says is weighed per character, the most said in the least
    space (the shortest reply that answers at all is often one that only names the topic); else
    whole. A reply answers when it says a word, the request makes it likelier (a gain above zero)
    and it says at least `ANSWERS_AT` of what the one that says the most says: told how to write,
    a small model often writes about the instruction or around the topic, replies the request
    makes a little likelier that answer nothing. Among those, the one the checks rank first
    (`shorter` by what it says, as weighed), ties to the one that says the most about the request;
    where no rule checks what was asked, the first (saying the most would favour the longest, what
    a person who asked for less, read as something else, does not want). None where none answers."""
    dense = [gain / max(1, characters(text)) for text, gain in zip(replies, gains)]
    said = dense if "shorter" in aspects and checkable(aspects) else gains
    answering = [j for j, (text, gain) in enumerate(zip(replies, gains)) if _WORD.search(text) and gain > 0]
    if not answering:
        return None
    most = max(said[j] for j in answering)
    answering = [j for j in answering if said[j] >= ANSWERS_AT * most]
    if not checkable(aspects):
        return answering[0]
    names = set(names_in(messages))
    total = _standardised(aspects, lambda aspect: dense if aspect == "shorter" else
                          [CHECKS[aspect](text, names) for text in replies], len(replies))
    top = max(total[j] for j in answering)
    return max((j for j in answering if total[j] > top - 1e-9), key=gains.__getitem__)
