"""Running normalisation of scores per key, for the composite judge.

Each key (a component, a task id and a step) keeps a running mean and variance (Welford's
algorithm, one pass, numerically stable). A score is normalised against the statistics of the
scores before it, never its own (a score counted in its own baseline is pulled toward 0, and by
how much depends on the order of arrival), then added to them:

- no score before it: 0. There is nothing to compare it with, and a made-up baseline would be
  signal that is not there.
- warm-up, while the key has seen fewer than `warmup` scores: the score minus their mean
  (centred only; a standard deviation from a handful of scores is too noisy to divide by).
- afterwards: (score - mean) / std, with std floored at `min_std` (a key whose scores never vary
  gives 0s, not huge numbers).

Where a whole group of attempts at one task is at hand, normalising within it removes the order
entirely: the trainer does that for per-turn rewards (`actor.turn_reward_norm: group`).

The statistics live in the judge loop's memory: a restarted judge warms up again.
"""

from __future__ import annotations

from collections.abc import Hashable

from flywheel.running_stats import RunningStats


class Normalizer:
    def __init__(self, warmup: int, min_std: float = 1e-6):
        self.warmup = warmup
        self.min_std = min_std
        self.stats: dict[Hashable, RunningStats] = {}

    def __call__(self, key: Hashable, value: float) -> float:
        """`value` normalised against its key's statistics so far (which it joins after)."""
        stats = self.stats.setdefault(key, RunningStats())
        if stats.n == 0:
            normalised = 0.0
        elif stats.n < self.warmup:
            normalised = value - stats.mean
        else:
            normalised = (value - stats.mean) / max(stats.std, self.min_std)
        stats.add(value)
        return normalised
