"""One training step's input: whole task groups turned into advantages, rows and minibatches.

Advantages are normalised within each group (`train/advantages.py`); each sample's segments
become rows with per-token advantages, sampling temperatures and the loss mask without the
tokens that cannot be trained (`train/sampled.py`); the samples are split into
`actor.ppo_n_minibatches` minibatches of about equal tokens, each packed (or padded) into
micro-batches of at most `train.micro_batch_tokens`.
"""

from __future__ import annotations

from collections import Counter
from statistics import fmean

from config import FlywheelConfig
from train.advantages import RunningBaseline, group_advantages, token_advantages
from train.grouping import Group
from train.packing import MicroBatch, Row, micro_batches, split_minibatches
from train.sampled import segment_sampling


class StepBatch:
    def __init__(self, groups: list[Group], config: FlywheelConfig, baseline: RunningBaseline, pad_id: int):
        samples = [s for g in groups for s in g.samples]
        keys = [g.key for g in groups for _ in g.members]
        self.n_samples = len(samples)
        rewards = [s.reward for s in samples]
        self.reward_mean = fmean(rewards)
        self.turns_mean = fmean(len(s.trajectory.turns) for s in samples)
        self.oldest_versions = [s.trajectory.oldest_version for s in samples]
        self.excluded: Counter[str] = Counter()
        train = config.train
        advantages = group_advantages(rewards, keys, baseline)
        per_sample: list[list[Row]] = []
        for sample, advantage in zip(samples, advantages):
            values = token_advantages(sample, advantage, train.turn_reward_coef, train.turn_discount)
            sampling = segment_sampling(sample.trajectory, self.excluded, config.model)
            per_sample.append([
                Row(segment, adv, s.temperatures, s.loss_mask, s.grammar)
                for segment, adv, s in zip(sample.trajectory.segments, values, sampling)
            ])
        self.minibatches: list[list[MicroBatch]] = [
            micro_batches(rows, train.micro_batch_tokens, pad_id, train.packing)
            for rows in split_minibatches(per_sample, config.actor.ppo_n_minibatches)
            if rows
        ]
