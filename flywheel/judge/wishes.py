"""What a person's correction asks to change, said as an instruction a small teacher follows
(`judge.teacher.wishes`).

Told a person's own words ("I can't read all that on my phone", "you never even say my name"),
SmolLM2-135M writes what they want no more often than untold; told a plain instruction, it
follows some (docs/experiments/learning-from-use.md). The teacher is what distillation moves the
person's adapter toward, so the judge reads which aspect of the reply a correction is about
(`ASPECTS`: its length, lists or prose, being named, register, language, code alone, a preamble,
plain words, examples; or anything else) and tells the teacher that aspect's instruction, with
the person's words after it (`beside`) or alone (`instead`). The person's remembered corrections
(`judge.teacher.memory`) are read together: the teacher is told what most of them ask for, each
read alone with at least `WISH_AT` confidence (a preamble read beside a shorter reply counts
for the shorter reply: `IMPLIED`). Where none is (corrections about anything else,
`other`: a wrong fact, a missed requirement; or too vague to read), it is told the words.

The reader is a linear classifier over hashed features of the words (flywheel/judge/hashed_classifier.py),
trained at first use (once per machine: `hashed_classifier.trained_once`) on
`flywheel/judge/data/correction_aspects_train*.jsonl` (corrections of
many people's styles and languages four helpers wrote from a brief) and the reaction reader's
complaints as `other`; another helper wrote the set it is measured on, unread by its author
(bench/judge_wishes.py).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from flywheel.bus.instructions import GREETING
from flywheel.judge import hashed_classifier
from flywheel.judge.hashed_classifier import HashedLinear, Reading, text_features, trained_once
from flywheel.judge.reaction_reader import load
from flywheel.judge.reaction_reader import training_set as reaction_training_set

ASPECTS: dict[str, str | None] = {
    "shorter": "Answer in one short sentence.",
    "longer": "Give a detailed answer that explains each point.",
    "list": "Format your answer as a list of 3 bullet points, one per line, each starting with \"- \".",
    "prose": "Write the answer as plain sentences: no lists, headings or markdown.",
    "name": f"Write your reply as a short note that starts with {GREETING}.",
    "formal": "Write in formal English: do not use contractions, exclamation marks or casual words.",
    "casual": "Write in a warm, relaxed, friendly tone.",
    "language": "Answer in the language the user asks for.",
    "code_only": "Reply with the code or command alone, without explanation.",
    "no_preamble": "Answer directly.",
    "simpler": "Explain it in plain words a beginner understands, without jargon.",
    "example": "Include a concrete example.",
    "other": None,
}
"""Each aspect's instruction to the teacher (None: the person's words are the instruction). For
`shorter`, `list`, `name` and `formal`, the phrasing SmolLM2-135M followed best of those tried
(docs/experiments/learning-from-use.md, section 4; for `name`, told the person's name: a greeting
filled where it is served or told, flywheel/bus/instructions.py). For `no_preamble`, of those
tried, the one after which replies answer as often as told nothing (bench/instruction_phrasings.py;
none moved the drill's answer-first check past the base's own; the one first written cost a fifth
of the answers, and held out, served to the three people whose corrections were read so, a blind
reader's answers went 0.15 -> 0.65, 0.42 before training). `casual` stays as first written: one
that answered more on the training questions answered less held out beside the greeting (0.21 ->
0.08, one person). The others are written, not measured."""
UNSERVED = frozenset({"casual"})
"""Aspects whose instruction the teacher is told but the gateway does not serve
(flywheel/judge/instruction_memory.py). Told before the question, every `casual` phrasing tried
cost answers (0.71-0.80 of the training questions answered by the bench's rule, 0.85 told
nothing) and none made the base write more casually than it does untold (a contraction or "!"
in 0.88 of its replies: bench/instruction_phrasings.py); held out, served beside the greeting, a
blind reader passed 0.21 of one person's replies against 0.38 before training."""
IMPLIED = {"no_preamble": "shorter"}
"""An aspect another's replies do too (one short sentence has no room for a preamble), whose votes
count for that one where a person's corrections read both. The reader takes `shorter` corrections
for `no_preamble` at times and not the reverse (held out: 4 of 22 and 0 of 22;
bench/judge_wishes.py), so a person whose corrections read both most likely wants less; served
`shorter` they are served a reply the checks can rank. Told "Answer directly." a brief person's
replies met their wish 0.04 of the time held out (docs/experiments/learning-from-use.md)."""
OPPOSITES = {"shorter": "longer", "longer": "shorter", "list": "prose", "prose": "list", "formal": "casual",
             "casual": "formal"}
"""Aspects that ask for opposite replies (the reader mistakes one for the other at times)."""
LABELS = tuple(ASPECTS)
TRAIN_DATA = Path(__file__).resolve().parent / "data"
TRAIN_FILES = "correction_aspects_train*.jsonl"
SOURCES = [__file__, hashed_classifier.__file__]
"""The code that reads a correction and names its aspects: a change to it trains the reader afresh."""
WISH_AT = 0.4
"""The least probability of an aspect for its instruction to be told: on the training set's 5-fold
cross-validation, 85 % of the form wishes are told and 92 % of what is told is right (bench/judge_wishes.py)."""


class WishReader:
    """Which of `ASPECTS` a correction is about, from labelled corrections (dicts with `text` and
    `aspect`)."""

    def __init__(self, examples: list[dict], once: bool = False):
        """Trained on `examples`; `once`: trained once per machine (`trained_once`)."""
        def train() -> HashedLinear:
            return HashedLinear.train(LABELS, [text_features(e["text"]) for e in examples], [e["aspect"] for e in examples])
        self.model = trained_once("wishes", examples, SOURCES, train) if once else train()

    def read(self, correction: str) -> Reading:
        probabilities = self.model.probabilities(text_features(correction))
        label = max(probabilities, key=probabilities.__getitem__)
        return Reading(label, probabilities[label])

    def aspects(self, corrections: list[str]) -> list[str]:
        """The aspects a person's corrections ask for most often, each correction read alone
        (ties: each); those read as `other` or below `WISH_AT` do not vote. One correction is
        often vague ("hmm, that's a lot"); a person's several point the same way."""
        return most_asked(map(self.aspect, corrections))

    def aspect(self, correction: str) -> str | None:
        """The aspect a correction is about, where it has an instruction and is read at `WISH_AT`
        or more; else None."""
        reading = self.read(correction)
        return reading.label if reading.probability >= WISH_AT and ASPECTS[reading.label] else None


def most_asked(aspects: Iterable[str | None]) -> list[str]:
    """The aspects read most often (ties: each); corrections none was read in (None, "") do not vote,
    and an `IMPLIED` aspect's votes count for the one that implies it where that is read too."""
    votes = Counter(aspect for aspect in aspects if aspect)
    for implied, by in IMPLIED.items():
        if votes[implied] and votes[by]:
            votes[by] += votes.pop(implied)
    return [aspect for aspect, n in votes.most_common() if n == max(votes.values())]


@dataclass
class Wish:
    """What a turn's corrections (its own first, then the person's earlier ones) ask for, as the
    teacher is told it under `judge.teacher.wishes` `mode`; each read at most once, when first asked."""

    corrections: list[str]
    mode: str

    @functools.cached_property
    def aspects(self) -> list[str]:
        """The aspects they ask for most often (`WishReader.aspects`)."""
        return wish_reader().aspects(self.corrections)

    @functools.cached_property
    def told(self) -> str:
        """`words`: the corrections; `beside`: the instructions of their `aspects`, then the
        corrections; `instead`: the instructions alone. The corrections wherever no instruction is
        read."""
        wanted = [] if self.mode == "words" else [ASPECTS[aspect] for aspect in self.aspects]
        return " ".join(wanted + self.corrections if self.mode == "beside" or not wanted else wanted)


def training_set() -> list[dict]:
    """The shipped labelled corrections, then the reaction reader's complaints as `other` (they
    say a reply is wrong, not how its form should change: "bad answer", "ugh this again"), in a
    fixed order."""
    complaints = [{"id": e["id"], "text": e["next"][0]["content"], "aspect": "other"}
                  for e in reaction_training_set() if e["gold"] == "complaint"]
    return [*(e for path in sorted(TRAIN_DATA.glob(TRAIN_FILES)) for e in load(path)), *complaints]


@functools.cache
def wish_reader() -> WishReader:
    """The process's reader, trained on the shipped corrections at first use, once per machine."""
    return WishReader(training_set(), once=True)
