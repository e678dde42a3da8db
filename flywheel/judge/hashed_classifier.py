"""A linear classifier over hashed features of text (fastText's recipe), what the judge's learned
readers of people's words are made of (flywheel/judge/reaction_reader.py, flywheel/judge/wishes.py).

`text_features` are a message's own: its words, word pairs and character 3-5-grams (typos and
inflections share most of theirs, and so do many languages' words), its first words, its
punctuation and its length; a reader adds what else it knows. `HashedLinear` hashes them into
`BUCKETS` rows of one embedding bag and trains it full batch from zeros on one thread, so that
every process that trains it from the same examples reads exactly alike; reading needs numpy
alone. `trained_once` keeps a trained one in the model cache, so that a judge that starts again
(or another process on the machine) loads it in milliseconds instead of training it for 10-15 s,
and reads exactly as the one that trained it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from flywheel.models.cache import cached_build

log = logging.getLogger(__name__)
BUCKETS = 1 << 16
FILE = "model.safetensors"
"""A trained reader's file in its cache directory (`trained_once`)."""
_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)


@dataclass(frozen=True)
class Reading:
    label: str
    probability: float


def text_features(message: str) -> list[str]:
    """The message's own features, as strings to hash."""
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
    return out


class HashedLinear:
    """Softmax regression over `labels`, from bags of feature strings: `train` fits one, rarer
    labels weighing more (by the square root of how much rarer). Reading is numpy's (a judge that
    reads never imports torch); training is torch's, once per machine (`trained_once`)."""

    def __init__(self, labels: tuple[str, ...], weights: np.ndarray, bias: np.ndarray):
        self.labels, self.weights, self.bias = labels, weights, bias

    @classmethod
    def train(cls, labels: tuple[str, ...], bags: list[list[str]], gold: list[str], steps: int = 100,
              lr: float = 0.3, weight_decay: float = 1e-5) -> HashedLinear:
        import torch

        from flywheel.torch_threads import one_thread

        ids, offsets, scale = (torch.from_numpy(array) for array in _pack([_hashed(bag) for bag in bags]))
        target = torch.tensor([labels.index(label) for label in gold])
        counts = torch.bincount(target, minlength=len(labels)).clamp(min=1).float()
        loss_fn = torch.nn.CrossEntropyLoss(weight=(counts.sum() / counts) ** 0.5)
        # Zeros, not a random draw (the process's RNG stays where it was); one thread, so that every
        # process sums in the same order.
        weights = torch.nn.EmbeddingBag.from_pretrained(torch.zeros(BUCKETS, len(labels)), freeze=False, mode="sum")
        bias = torch.nn.Parameter(torch.zeros(len(labels)))
        optimizer = torch.optim.Adam([weights.weight, bias], lr=lr)
        with one_thread():
            for _ in range(steps):  # full batch: deterministic, and a step is a few milliseconds
                logits = weights(ids, offsets, per_sample_weights=scale) + bias
                loss = loss_fn(logits, target) + weight_decay * weights.weight.pow(2).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        return cls(labels, weights.weight.detach().numpy(), bias.detach().numpy())

    @classmethod
    def load(cls, path: Path) -> HashedLinear:
        """A classifier `save` wrote."""
        with safe_open(path, "np") as f:
            return cls(tuple(json.loads(f.metadata()["labels"])), f.get_tensor("weights"), f.get_tensor("bias"))

    def save(self, path: Path) -> None:
        save_file({"weights": np.ascontiguousarray(self.weights), "bias": self.bias}, path,
                  metadata={"labels": json.dumps(self.labels)})

    def probabilities(self, bag: list[str]) -> dict[str, float]:
        ids, _, scale = _pack([_hashed(bag)])
        logits = scale @ self.weights[ids] + self.bias
        exp = np.exp(logits - logits.max())
        return dict(zip(self.labels, (exp / exp.sum()).tolist()))


def _hashed(items: list[str]) -> list[int]:
    return [zlib.crc32(item.encode()) % BUCKETS for item in items] or [0]


def _pack(batch: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EmbeddingBag's flat ids, offsets and per-id weights (1/sqrt of each bag's size)."""
    ids = np.array([i for bag in batch for i in bag], dtype=np.int64)
    offsets = np.array([0, *accumulate(len(bag) for bag in batch)][:-1], dtype=np.int64)
    scale = np.array([1 / math.sqrt(len(bag)) for bag in batch for _ in bag], dtype=np.float32)
    return ids, offsets, scale


def trained_once(name: str, examples: list[dict], sources: list[str], train: Callable[[], HashedLinear]) -> HashedLinear:
    """What `train` makes of `examples`, trained once per machine: kept in the model cache
    (`cache_root()/readers/<name>-<digest>`) under a digest of the examples, the code that reads
    them and names its labels (`sources`, files) and torch's version, so a change to any of them
    trains it afresh; a damaged file is trained again."""
    digest = hashlib.sha256(json.dumps(examples, sort_keys=True).encode())
    for source in sorted(sources):
        digest.update(Path(source).read_bytes())
    digest.update(importlib.metadata.version("torch").encode())
    name = f"readers/{name}-{digest.hexdigest()[:24]}"

    def build(directory: Path) -> None:
        train().save(directory / FILE)

    def readable(directory: Path) -> bool:
        try:
            HashedLinear.load(directory / FILE)
        except (OSError, ValueError, KeyError, SafetensorError) as exc:
            log.info("the cached reader %s cannot be read: %s", directory, exc)  # the cache says what it does
            return False
        return True
    return HashedLinear.load(cached_build(name, build, readable) / FILE)
