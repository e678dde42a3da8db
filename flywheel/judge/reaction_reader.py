"""A learned reader of what a person says after an assistant's reply: which of `READ_LABELS` it
is (a correction, a complaint, a retry, approval, thanks, moving on to something new, unclear),
with no list of phrasings.

The model is a linear classifier over hashed features of the message and of how it relates to
the turn (fastText's recipe, trained at first use: about 11 s on one thread of a small CPU): the message's words, word pairs
and character n-grams (typos and inflections share most of theirs, and so do many languages'
words), its first words, its punctuation, its length, and how much of its content the request
and the reply already hold (a restated request is a retry; a message that speaks of the reply's
words reacts to it; one that names new things asks something new). It learns from
`flywheel/judge/data/reactions_train*.jsonl`, reactions of many people's styles and languages
written by a helper from a brief (the people who wrote the evaluation sets never saw it, and
the author of the reader never read those: `bench/judge_reactions.py`).

`ReactionReader.read` gives the label and its probability; `reader()` is the process's one reader,
trained from the shipped examples on first use (the `next_state` judge trains it when it starts,
off its event loop), on one thread, so that every process reads alike.
"""

from __future__ import annotations

import functools
import json
import math
import re
import zlib
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch

from flywheel.judge.next_state_rules import classify_user_text
from flywheel.torch_threads import one_thread

READ_LABELS = ("correction", "complaint", "retry", "acceptance", "thanks", "moving_on", "unclear")
TRAIN_DATA = Path(__file__).resolve().parent / "data"
TRAIN_FILES = "reactions_train*.jsonl"
BUCKETS = 1 << 16
NEGATIVE = ("correction", "complaint")
NEGATIVE_AT = 0.6
"""Chosen on the training set's 5-fold cross-validation (bench/judge_reactions.py)."""
_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)


@dataclass(frozen=True)
class Reading:
    label: str
    probability: float


def _content(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.lower()) if len(w) >= 4}


def _bucket(fraction: float) -> int:
    return 0 if fraction == 0 else 1 if fraction < 0.34 else 2 if fraction < 0.67 else 3


def features(message: str, request: str = "", reply: str = "", rule: str | None = None) -> list[str]:
    """The message's features, as strings to hash (`rule`: the rules' class of it, when known)."""
    tokens = _TOKEN.findall(message.lower().replace("\u2019", "'"))
    words = [t for t in tokens if t[0].isalnum() or t[0] == "_"]
    out = [f"w:{w}" for w in words]
    out += [f"b:{a} {b}" for a, b in zip(tokens, tokens[1:])]
    for w in words:
        padded = f"<{w}>"
        out += [f"c:{padded[i:i + n]}" for n in (3, 4, 5) for i in range(len(padded) - n + 1)]
    out += [f"f:{' '.join(words[:k])}" for k in (1, 2) if len(words) >= k]
    out += [f"p:{t}" for t in tokens if not t[0].isalnum() and t[0] != "_"]
    out.append(f"end:{message.strip()[-1:]}")
    out.append(f"len:{min(len(words), 40) // 4}")
    out.append(f"rule:{rule or classify_user_text(message, request, reply).label}")
    said, asked, replied = _content(message), _content(request), _content(reply)
    if said:
        out.append(f"req:{_bucket(len(said & asked) / len(said))}")
        out.append(f"rep:{_bucket(len(said & replied) / len(said))}")
        out.append(f"new:{_bucket(len(said - asked - replied) / len(said))}")
    return out


def _hashed(items: list[str]) -> list[int]:
    return [zlib.crc32(item.encode()) % BUCKETS for item in items] or [0]


class ReactionReader:
    """A linear classifier over hashed features, trained on labelled reactions (dicts with
    `request`, `reply`, `next` (the user's message first) and `gold`, one of `READ_LABELS`)."""

    def __init__(self, examples: list[dict], steps: int = 100, lr: float = 0.3, weight_decay: float = 1e-5):
        ids, offsets, scale = _pack([_hashed(features(_said(e), e.get("request", ""), e.get("reply", "")))
                                     for e in examples])
        gold = torch.tensor([READ_LABELS.index(e["gold"]) for e in examples])
        counts = torch.bincount(gold, minlength=len(READ_LABELS)).clamp(min=1).float()
        loss_fn = torch.nn.CrossEntropyLoss(weight=(counts.sum() / counts) ** 0.5)  # rarer classes count more
        # Zeros, not a random draw (the process's RNG stays where it was); one thread, so that every
        # process sums in the same order and every judge reads alike.
        self.weights = torch.nn.EmbeddingBag.from_pretrained(torch.zeros(BUCKETS, len(READ_LABELS)), freeze=False,
                                                             mode="sum")
        self.bias = torch.nn.Parameter(torch.zeros(len(READ_LABELS)))
        optimizer = torch.optim.Adam([self.weights.weight, self.bias], lr=lr)
        with one_thread():
            for _ in range(steps):  # full batch: deterministic, and a step is a few milliseconds
                logits = self.weights(ids, offsets, per_sample_weights=scale) + self.bias
                loss = loss_fn(logits, gold) + weight_decay * self.weights.weight.pow(2).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        self.weights.requires_grad_(False)
        self.bias.requires_grad_(False)

    def probabilities(self, message: str, request: str = "", reply: str = "", rule: str | None = None) -> dict[str, float]:
        ids, offsets, scale = _pack([_hashed(features(message, request, reply, rule))])
        with torch.no_grad():
            p = torch.softmax(self.weights(ids, offsets, per_sample_weights=scale)[0] + self.bias, -1)
        return dict(zip(READ_LABELS, p.tolist()))

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


def _pack(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EmbeddingBag's flat ids, offsets and per-id weights (1/sqrt of each bag's size)."""
    ids = torch.tensor([i for bag in batch for i in bag])
    offsets = torch.tensor([0, *accumulate(len(bag) for bag in batch)][:-1])
    scale = torch.tensor([1 / math.sqrt(len(bag)) for bag in batch for _ in bag])
    return ids, offsets, scale


def load(path: Path) -> list[dict]:
    """The labelled reactions of a JSON-lines file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_set() -> list[dict]:
    """The shipped training reactions (every `TRAIN_FILES` of `TRAIN_DATA`), in a fixed order."""
    return [e for path in sorted(TRAIN_DATA.glob(TRAIN_FILES)) for e in load(path)]


@functools.cache
def reader() -> ReactionReader:
    """The process's reader, trained on the shipped examples at first use."""
    return ReactionReader(training_set())
