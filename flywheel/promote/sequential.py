"""The canary's sequential test: promote or roll back as soon as the evidence is enough.

Two arms run side by side on concurrent sessions: the serving version and the canary. Each
judged session adds its reward to its arm. With Δ the difference of the arms' mean rewards
(canary − serving), the test weighs H_ok: Δ = 0 (no worse) against H_bad: Δ = −δ (harmful by
the margin `canary.delta`). Its statistic is Wald's log-likelihood ratio for a normal estimate
Δ̂ with information I = 1 / Var(Δ̂), Var = s²·(1/n_canary + 1/n_serving) with s² the arms' pooled
sample variance (floored; pooled because the serving arm's many sessions steady it):

    LLR = I·δ·(Δ̂ + δ/2)

It promotes when LLR ≥ log((1 − β)/α), rolls back when LLR ≤ log(β/(1 − α)), and otherwise
waits for more sessions; both arms need `min_sessions` first. At `max_sessions` canary sessions
it must decide: promote when Δ̂ > −δ/2 (the estimate is nearer no harm than harm), else roll
back. α bounds the chance of promoting a canary δ worse, β that of rolling back one that is no
worse: Wald's boundaries keep both errors at or under their targets for a continuously watched
Brownian motion, and the discrete, plug-in version here is checked by simulation (`simulate`;
`bench/canary_error_rates.py` prints the operating characteristics, tests/test_sequential.py
asserts them).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from flywheel.running_stats import RunningStats

Verdict = Literal["promote", "rollback"]


@dataclass(frozen=True)
class Decision:
    verdict: Verdict | None
    """None: not enough evidence yet."""
    llr: float
    estimate: float
    """Δ̂: the canary's mean reward minus the serving version's."""
    reason: str


@dataclass(frozen=True)
class SequentialTest:
    delta: float
    alpha: float
    beta: float
    min_sessions: int
    max_sessions: int
    variance_floor: float = 0.01

    @property
    def promote_at(self) -> float:
        return math.log((1 - self.beta) / self.alpha)

    @property
    def rollback_at(self) -> float:
        return math.log(self.beta / (1 - self.alpha))

    def decide(self, canary: RunningStats, serving: RunningStats) -> Decision:
        if min(canary.n, serving.n) < self.min_sessions:
            return Decision(None, 0.0, canary.mean - serving.mean,
                            f"waiting: {canary.n} canary and {serving.n} serving sessions judged, {self.min_sessions} each needed")
        estimate = canary.mean - serving.mean
        pooled = max((canary.m2 + serving.m2) / (canary.n + serving.n - 2), self.variance_floor)
        variance = pooled * (1 / canary.n + 1 / serving.n)
        llr = self.delta * (estimate + self.delta / 2) / variance
        said = f"Δ̂ = {estimate:+.3f} over {canary.n} canary / {serving.n} serving sessions, LLR {llr:+.2f}"
        if llr >= self.promote_at:
            return Decision("promote", llr, estimate, f"{said} ≥ {self.promote_at:.2f}: no worse (α = {self.alpha})")
        if llr <= self.rollback_at:
            return Decision("rollback", llr, estimate, f"{said} ≤ {self.rollback_at:.2f}: worse by δ = {self.delta} (β = {self.beta})")
        if canary.n >= self.max_sessions:
            verdict: Verdict = "promote" if estimate > -self.delta / 2 else "rollback"
            return Decision(verdict, llr, estimate, f"{said}: undecided at {self.max_sessions} canary sessions, "
                            f"the estimate is nearer {'no harm' if verdict == 'promote' else 'harm'}")
        return Decision(None, llr, estimate, f"{said}: undecided")


def simulate(test: SequentialTest, true_delta: float, share: float, runs: int, seed: int = 0,
             base_rate: float = 0.5) -> dict[str, float]:
    """Operating characteristics by simulation: sessions end one at a time, a `share` of them
    canary's; rewards are 0/1 with success rate `base_rate` (serving) and `base_rate + true_delta`
    (canary). Returns the share of runs promoted and the mean canary sessions to a decision."""
    rng = random.Random(seed)
    promoted, used = 0, 0
    canary_rate = min(max(base_rate + true_delta, 0.0), 1.0)
    for _ in range(runs):
        canary, serving = RunningStats(), RunningStats()
        while True:
            if rng.random() < share:
                canary.add(float(rng.random() < canary_rate))
            else:
                serving.add(float(rng.random() < base_rate))
            decision = test.decide(canary, serving)
            if decision.verdict is not None:
                promoted += decision.verdict == "promote"
                used += canary.n
                break
    return {"promoted": promoted / runs, "canary_sessions_mean": used / runs}
