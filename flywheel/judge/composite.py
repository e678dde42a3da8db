"""The `composite` judge: a weighted combination of other judges (`rule`, `llm`, `model`).

Every component scores the trajectory concurrently. Then, per turn t and for the outcome:

    turn_rewards[t] = sum over components i of  weight_i * n_i(turn_rewards_i[t])
    reward          = sum over components i of  weight_i * n_i(reward_i)

where n_i is the identity, or with `normalize: true` a running normalisation per key
(`flywheel/judge/normalize.py`): the key of a turn score is (component, task_id, thread, place in the
thread) and of an outcome (component, task_id, "outcome"), so a turn is compared with the same
step of the same task (trajectories without a task id share the key None).

A component that cannot score the trajectory makes the whole trajectory `Unscorable` if it is
`required` (the default); an optional one is left out of both sums and named in
`details["skipped"]` (e.g. a `rule` component when no feedback came). With every component
skipped, the trajectory is unscorable. The weighted sum is not renormalised: weights are the
scale the trainer sees. As for every judge, a turn's reward applies to every sampled token of
that turn and the outcome to every sampled token of the trajectory (the trainer applies them).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from flywheel.bus import Trajectory
from flywheel.judge.base import Judge, Unscorable, Verdict
from flywheel.judge.normalize import Normalizer


@dataclass
class Component:
    judge: Judge
    weight: float
    required: bool = True


class CompositeJudge(Judge):
    name = "composite"

    def __init__(self, components: list[Component], normalizer: Normalizer | None = None):
        self.components = components
        self.normalizer = normalizer
        self.labels = [f"{i}:{c.judge.name}" for i, c in enumerate(components)]
        """Each component's name in details and normalisation keys (a kind may appear twice)."""

    async def start(self) -> None:
        await asyncio.gather(*(c.judge.start() for c in self.components))

    async def close(self) -> None:
        await asyncio.gather(*(c.judge.close() for c in self.components))

    @property
    def identity(self) -> str | None:
        models = [f"{label}: {c.judge.identity}" for label, c in zip(self.labels, self.components) if c.judge.identity]
        return "; ".join(models) or None

    def stats(self) -> dict:
        return {label: c.judge.stats() for label, c in zip(self.labels, self.components)}

    async def score(self, trajectory: Trajectory) -> Verdict:
        results = await asyncio.gather(*(c.judge.score(trajectory) for c in self.components), return_exceptions=True)
        reward, turn_rewards = 0.0, [0.0] * len(trajectory.turns)
        details: dict = {"components": {}, "skipped": {}}
        for label, component, result in zip(self.labels, self.components, results):
            if isinstance(result, Unscorable):
                if component.required:
                    raise Unscorable(result.category, f"component {label}: {result.detail}")
                details["skipped"][label] = result.reason
                continue
            if isinstance(result, BaseException):
                raise result
            outcome, turns = self._normalised(label, trajectory, result)
            reward += component.weight * outcome
            turn_rewards = [total + component.weight * r for total, r in zip(turn_rewards, turns)]
            details["components"][label] = {
                "weight": component.weight, "reward": result.reward, "turn_rewards": result.turn_rewards,
                "normalised_reward": outcome, "normalised_turn_rewards": turns, "details": result.details,
            }
        if not details["components"]:
            raise Unscorable("no component scored", "; ".join(f"{k}: {v}" for k, v in details["skipped"].items()))
        return Verdict(reward, turn_rewards, details)

    def _normalised(self, label: str, trajectory: Trajectory, verdict: Verdict) -> tuple[float, list[float]]:
        if self.normalizer is None:
            return verdict.reward, verdict.turn_rewards
        task = trajectory.task_id
        turns = [self.normalizer((label, task, *step), r) for step, r in zip(trajectory.thread_positions(), verdict.turn_rewards)]
        return self.normalizer((label, task, "outcome"), verdict.reward), turns
