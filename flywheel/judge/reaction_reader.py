"""A learned reader of what a person says after an assistant's reply: which of `READ_LABELS` it
is (a correction, a complaint, a retry, approval, thanks, moving on to something new, unclear),
with no list of phrasings.

The model is a linear classifier over hashed features of the message and of how it relates to
the turn (flywheel/judge/hashed_classifier.py; trained at first use: about 10 s on one thread of
a small CPU): the message's own (words, word pairs, character n-grams, first words, punctuation,
length), the rules' class of it, and how much of its content the request
and the reply already hold (a restated request is a retry; a message that speaks of the reply's
words reacts to it; one that names new things asks something new). It learns from
`flywheel/judge/data/reactions_train*.jsonl`, reactions of many people's styles and languages
written by a helper from a brief (the people who wrote the evaluation sets never saw it, and
the author of the reader never read those: `bench/judge_reactions.py`).

`ReactionReader.read` gives the label and its probability; `reader()` is the process's one reader,
trained from the shipped examples on first use (the `next_state` judge trains it when it starts,
off its event loop), on one thread, so that every process reads alike, and once per machine
(kept in the model cache: `hashed_classifier.trained_once`).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from flywheel.judge import hashed_classifier, next_state_classes, next_state_rules, next_state_tool_output
from flywheel.judge.hashed_classifier import HashedLinear, Reading, text_features, trained_once
from flywheel.judge.next_state_rules import classify_user_text

SOURCES = [__file__, *(module.__file__ for module in (hashed_classifier, next_state_classes, next_state_rules,
                                                      next_state_tool_output))]
"""The code that reads a reaction: a change to it trains the reader afresh."""
READ_LABELS = ("correction", "complaint", "retry", "acceptance", "thanks", "moving_on", "unclear")
TRAIN_DATA = Path(__file__).resolve().parent / "data"
TRAIN_FILES = "reactions_train*.jsonl"
NEGATIVE = ("correction", "complaint")
NEGATIVE_AT = 0.6
"""Chosen on the training set's 5-fold cross-validation (bench/judge_reactions.py)."""


def _content(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.lower()) if len(w) >= 4}


def _bucket(fraction: float) -> int:
    return 0 if fraction == 0 else 1 if fraction < 0.34 else 2 if fraction < 0.67 else 3


def features(message: str, request: str = "", reply: str = "", rule: str | None = None) -> list[str]:
    """The message's features, as strings to hash (`rule`: the rules' class of it, when known)."""
    out = text_features(message)
    out.append(f"rule:{rule or classify_user_text(message, request, reply).label}")
    said, asked, replied = _content(message), _content(request), _content(reply)
    if said:
        out.append(f"req:{_bucket(len(said & asked) / len(said))}")
        out.append(f"rep:{_bucket(len(said & replied) / len(said))}")
        out.append(f"new:{_bucket(len(said - asked - replied) / len(said))}")
    return out


class ReactionReader:
    """A linear classifier over hashed features, trained on labelled reactions (dicts with
    `request`, `reply`, `next` (the user's message first) and `gold`, one of `READ_LABELS`)."""

    def __init__(self, examples: list[dict], once: bool = False):
        """Trained on `examples`; `once`: trained once per machine (`trained_once`)."""
        def train() -> HashedLinear:
            bags = [features(_said(e), e.get("request", ""), e.get("reply", "")) for e in examples]
            return HashedLinear.train(READ_LABELS, bags, [e["gold"] for e in examples])
        self.model = trained_once("reactions", examples, SOURCES, train) if once else train()

    def probabilities(self, message: str, request: str = "", reply: str = "", rule: str | None = None) -> dict[str, float]:
        return self.model.probabilities(features(message, request, reply, rule))

    def read(self, message: str, request: str = "", reply: str = "", rule: str | None = None) -> Reading:
        """The most likely label of a message after a reply to `request`; a correction or a
        complaint only when the two together are at least `NEGATIVE_AT` likely (a new request
        read as one teaches the wrong thing, so the reader leans the other way)."""
        probabilities = self.probabilities(message, request, reply, rule)
        negative = probabilities["correction"] + probabilities["complaint"]
        allowed = [label for label in READ_LABELS if negative >= NEGATIVE_AT or label not in NEGATIVE]
        label = max(allowed, key=probabilities.__getitem__)
        return Reading(label, probabilities[label])


def _said(example: dict) -> str:
    return next((m["content"] for m in example["next"] if m.get("role") == "user"), "")


def load(path: Path) -> list[dict]:
    """The labelled reactions of a JSON-lines file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_set() -> list[dict]:
    """The shipped training reactions (every `TRAIN_FILES` of `TRAIN_DATA`), in a fixed order."""
    return [e for path in sorted(TRAIN_DATA.glob(TRAIN_FILES)) for e in load(path)]


@functools.cache
def reader() -> ReactionReader:
    """The process's reader, trained on the shipped examples at first use, once per machine."""
    return ReactionReader(training_set(), once=True)
