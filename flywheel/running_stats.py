"""Running mean and variance of a stream of numbers (Welford's one-pass algorithm, numerically
stable), small enough to keep in a record: the composite judge normalises scores with it
(flywheel/judge/normalize.py), and the promotion loop keeps each canary arm's rewards in the version
registry with it (flywheel/promote/sequential.py, as `as_dict`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RunningStats:
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    """Sum of squared differences from the mean."""

    def add(self, value: float) -> None:
        self.n += 1
        step = value - self.mean
        self.mean += step / self.n
        self.m2 += step * (value - self.mean)

    @property
    def std(self) -> float:
        """The sample standard deviation (0 below two values)."""
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"n": self.n, "mean": self.mean, "m2": self.m2}

    @classmethod
    def from_dict(cls, raw: dict[str, float]) -> "RunningStats":
        return cls(int(raw["n"]), float(raw["mean"]), float(raw["m2"]))
