"""Advantages from sample rewards.

Samples that share a task id and are in the same batch form a group (the n samples of one
prompt): their advantage is the reward minus the group mean, divided by the group's standard
deviation (0 when all rewards are equal: nothing to learn from that group). A sample with no
group peer in the batch (live traffic: one sample per prompt) uses a running baseline instead:
reward minus an exponential moving average of past rewards. The advantage of a sample applies
to every sampled token of its trajectory.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean, pstdev


class RunningBaseline:
    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.value: float | None = None

    def update(self, reward: float) -> None:
        self.value = reward if self.value is None else self.decay * self.value + (1 - self.decay) * reward


def group_advantages(
    rewards: list[float], groups: list[str | None], baseline: RunningBaseline, eps: float = 1e-6
) -> list[float]:
    members: dict[str, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        if group is not None:
            members[group].append(i)
    advantages = [0.0] * len(rewards)
    alone = [i for i, g in enumerate(groups) if g is None or len(members[g]) < 2]
    for indices in members.values():
        if len(indices) < 2:
            continue
        values = [rewards[i] for i in indices]
        mean, std = fmean(values), pstdev(values)
        for i in indices:
            advantages[i] = 0.0 if std < eps else (rewards[i] - mean) / (std + eps)
    for i in alone:
        advantages[i] = rewards[i] - (baseline.value if baseline.value is not None else rewards[i])
        baseline.update(rewards[i])
    return advantages
