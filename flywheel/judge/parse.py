"""Reading a score out of a judge's reply.

The judge's final labelled number wins: every `score` label (`Score: 7`, `**Score:** 8/10`,
`score = 0.8`, `Final score - 6`, `the score is 5`, JSON `{"score": 3}`) and every `\\boxed{N}` in the reply is
found, and the one that comes last is the vote (so a reply that quotes a score before giving
its own is read right). A `/10`-style denominator after the number is ignored: the number is
read on the configured scale. A reply with no labelled number, or one outside
[score_min, score_max], is an invalid vote with a reason; it is never read as zero.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_NUMBER = r"(?P<number>[-+]?(?:\d+(?:\.\d*)?|\.\d+))"
_DECORATION = r"[\s*_\"'`]*"
_LABELLED = re.compile(
    rf"(?:\bscore{_DECORATION}(?:[:=]|-(?!\d)|\bis\b){_DECORATION}|\\boxed\{{\s*){_NUMBER}",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Vote:
    score: float | None
    """The score read, or None for an invalid vote."""
    problem: str | None = None
    """Why the vote is invalid: `no score` or `out of range`."""

    @property
    def valid(self) -> bool:
        return self.score is not None


def parse_score(reply: str, score_min: float, score_max: float) -> Vote:
    """The vote in `reply`: its last labelled number, checked against the scale."""
    matches = list(_LABELLED.finditer(reply or ""))
    if not matches:
        return Vote(None, "no score")
    value = float(matches[-1].group("number"))
    if not math.isfinite(value) or not score_min <= value <= score_max:
        return Vote(None, "out of range")
    return Vote(value)
