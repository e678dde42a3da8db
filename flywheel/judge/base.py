"""What every judge is: `await judge.score(trajectory)` gives a `Verdict` or raises `Unscorable`.

A `Verdict` has the trajectory's outcome `reward`, per-turn `turn_rewards` aligned with
`trajectory.turns`, and `details` for people (votes, component scores, ...). How the two kinds
of reward reach the policy (see docs/judges.md): a turn's reward belongs to every sampled token
of that turn (the tokens inside the turn's `Segment.turn_spans`), the outcome to every sampled
token of the trajectory; the trainer applies them. Judges that score turns derive the outcome
from the turn rewards with `outcome_of` (`mean`, `last` or `min`).

A judge that cannot score a trajectory raises `Unscorable(category, detail)`: the judge loop
publishes it as an `Unscored` record with the reason, never as a silent zero. `category` is a
short fixed label the loop counts by; `detail` says what exactly happened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, Literal

from flywheel.bus import Trajectory


@dataclass
class Verdict:
    reward: float
    """The trajectory's outcome reward."""
    turn_rewards: list[float]
    """One reward per `trajectory.turns` entry."""
    details: dict[str, Any] = field(default_factory=dict)
    """What the judge saw and decided (JSON-serialisable), published with the sample."""

    def check(self, trajectory: Trajectory) -> None:
        """Raise `Unscorable` unless the rewards are finite and there is one per turn."""
        if len(self.turn_rewards) != len(trajectory.turns):
            raise Unscorable("invalid verdict", f"{len(self.turn_rewards)} turn rewards for {len(trajectory.turns)} turns")
        if not all(math.isfinite(r) for r in [self.reward, *self.turn_rewards]):
            raise Unscorable("invalid verdict", f"a reward is not finite: {self.reward}, {self.turn_rewards}")


class Unscorable(Exception):
    """The judge cannot score this trajectory (reported as `Unscored`, never as zero)."""

    def __init__(self, category: str, detail: str):
        super().__init__(f"{category}: {detail}")
        self.category = category
        self.detail = detail

    @property
    def reason(self) -> str:
        return str(self)


class Judge:
    """Base of the judges. `start` acquires what the judge needs (a model, a connection) and
    `close` releases it; both default to nothing."""

    name: str = "judge"

    async def start(self) -> None:
        pass

    async def score(self, trajectory: Trajectory) -> Verdict:
        raise NotImplementedError

    async def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        """Counters for the loop's stats (requests, retries, ...); none by default."""
        return {}

    @property
    def identity(self) -> str | None:
        """The model behind this judge's scores and which weights (`Sample.judge_model`); None for
        judges without one."""
        return None


Outcome = Literal["mean", "last", "min"]


def outcome_of(turn_rewards: list[float], how: Outcome) -> float:
    """The outcome reward from turn rewards: their mean, the last one, or the smallest."""
    if not turn_rewards:
        raise Unscorable("no turns", "the trajectory has no assistant turn to score")
    if how == "last":
        return turn_rewards[-1]
    if how == "min":
        return min(turn_rewards)
    return fmean(turn_rewards)
