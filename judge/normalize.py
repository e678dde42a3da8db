"""Running normalisation of scores per key, for the composite judge.

Each key (a component, a task id and a turn index) keeps a running mean and variance (Welford's
algorithm, one pass, numerically stable). A score is first added to its key's statistics,
then normalised against them:

- warm-up, while the key has seen fewer than `warmup` scores: the score minus the running mean
  (centred only; a standard deviation from a handful of scores is too noisy to divide by). The
  first score of a key therefore normalises to 0.
- afterwards: (score - mean) / std, with std floored at `min_std` (a key whose scores never vary
  gives 0s, not huge numbers).

The statistics live in the judge loop's memory: a restarted judge warms up again.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass
class RunningStats:
    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    """Sum of squared differences from the mean (Welford)."""

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0


class Normalizer:
    def __init__(self, warmup: int, min_std: float = 1e-6):
        self.warmup = warmup
        self.min_std = min_std
        self.stats: dict[Hashable, RunningStats] = {}

    def __call__(self, key: Hashable, value: float) -> float:
        """`value` normalised against its key's running statistics (which it joins first)."""
        stats = self.stats.setdefault(key, RunningStats())
        stats.add(value)
        centred = value - stats.mean
        if stats.count < self.warmup:
            return centred
        return centred / max(stats.std, self.min_std)
