"""Advantages from sample rewards, per sample and per token.

Samples that share a task id and are in the same batch form a group (the n samples of one
prompt): their advantage is the reward minus the group mean, divided by the group's standard
deviation (0 when all rewards are equal: nothing to learn from that group). A sample with no
group peer in the batch (live traffic: one sample per prompt) uses a running baseline instead:
reward minus an exponential moving average of past rewards.

Per token (`token_advantages`): a sample's advantage A applies to every sampled token of its
trajectory. A judge may also give per-turn rewards r_0..r_{K-1} (`Sample.turn_rewards`, aligned
with the trajectory's turns, e.g. a process-reward judge's score of each assistant turn or
feedback about one turn). Turn k's sampled tokens then get

    A + β · Σ_{j ≥ k, j in k's thread} γ^(j−k) · r_j

(β = `actor.turn_reward_coef`, γ = `actor.turn_discount`): a turn is credited with its own
reward and, discounted, those of the later turns of its own conversation, which it led to
(γ = 0: its own only); a sub-agent's rewards are not the main agent's. Turns are found by their
place in the trajectory (the k-th span over the segments is `turns[k]`), never by `turn_index`,
which two turns of one session may share. The outcome is not discounted: it is the trajectory's
result, owed to every turn alike. Tokens off the loss mask get 0. β defaults to 0 (the outcome
alone).

Per-turn rewards get a baseline where the trainer holds a whole group (`group_turn_rewards`,
`actor.turn_reward_norm: group`): the rewards of the same step (thread and place in it) across
the group's members are normalised like outcomes, (r − mean) / std, so the order in which the
members were judged does not matter (a step only one member reached gets 0).
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean, pstdev

from flywheel.bus import Sample


class RunningBaseline:
    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.value: float | None = None
        self.adapters: dict[str, RunningBaseline] = {}
        """Each adapter's own baseline (`adapters.kind: lora`): one user's rewards say nothing
        of what another's mean."""

    def of(self, adapter: str) -> "RunningBaseline":
        return self.adapters.setdefault(adapter, RunningBaseline(self.decay))

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


def turn_returns(turn_rewards: list[float], discount: float) -> list[float]:
    """Σ_{j ≥ k} γ^(j−k) r_j for each turn k."""
    returns, running = [0.0] * len(turn_rewards), 0.0
    for k in range(len(turn_rewards) - 1, -1, -1):
        running = turn_rewards[k] + discount * running
        returns[k] = running
    return returns


def group_turn_rewards(samples: list[Sample], eps: float = 1e-6) -> list[list[float]]:
    """The per-turn rewards of one group's samples, each normalised among the rewards of the same
    step (thread, place in it) of the other members and itself: (r − mean) / std, 0 where the
    step's rewards are all equal or only one member reached it."""
    steps: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for i, sample in enumerate(samples):
        for k, step in enumerate(sample.trajectory.thread_positions()[:len(sample.turn_rewards)]):
            steps[step].append((i, k))
    out = [[0.0] * len(sample.turn_rewards) for sample in samples]
    for members in steps.values():
        values = [samples[i].turn_rewards[k] for i, k in members]
        mean, std = fmean(values), pstdev(values)
        for (i, k), value in zip(members, values):
            out[i][k] = 0.0 if std < eps else (value - mean) / (std + eps)
    return out


def token_advantages(sample: Sample, advantage: float, coef: float, discount: float,
                     turn_rewards: list[float] | None = None) -> list[list[float]]:
    """One list per segment of `sample.trajectory`: each token's advantage (0 off the mask).
    `turn_rewards` replaces the sample's own (e.g. normalised within its group)."""
    trajectory = sample.trajectory
    rewards = sample.turn_rewards if turn_rewards is None else turn_rewards
    per_turn = [0.0] * len(trajectory.turns)
    if coef and rewards:
        threads: dict[int, list[int]] = defaultdict(list)
        for position, (thread, _) in enumerate(trajectory.thread_positions()):
            threads[thread].append(position)
        for positions in threads.values():
            returns = turn_returns([rewards[p] for p in positions], discount)
            for p, g in zip(positions, returns):
                per_turn[p] = coef * g
    out, position = [], 0
    for segment in trajectory.segments:
        values = [0.0] * len(segment.token_ids)
        for _, start, end in segment.turn_spans:
            value = advantage + (per_turn[position] if position < len(per_turn) else 0.0)
            values[start:end] = [value if m else 0.0 for m in segment.loss_mask[start:end]]
            position += 1
        out.append(values)
    return out
