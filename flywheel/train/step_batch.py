"""One training step's input: whole task groups turned into advantages, rows and minibatches.

Advantages are normalised within each group, and per-turn rewards per step of the group
(`actor.turn_reward_norm`; `flywheel/train/advantages.py`); each sample's segments
become rows with per-token advantages, sampling temperatures and the loss mask without the
tokens that cannot be trained (`flywheel/train/trainable_tokens.py`); the samples are split into
`actor.ppo_n_minibatches` minibatches of about equal tokens, each packed (or padded) into
micro-batches of at most `train.micro_batch_tokens`. With `adapters.kind: lora` each sample
trains one adapter (`flywheel.models.adapter_names.sample_adapter`); each adapter's samples are
split and packed apart, so every micro-batch is one adapter's, and minibatch i holds every
adapter's i-th.
"""

from __future__ import annotations

import math
from collections import Counter
from statistics import fmean

from flywheel.config import FlywheelConfig
from flywheel.models.adapter_names import origin, sample_adapter
from flywheel.train.advantages import (
    RunningBaseline,
    group_advantages,
    group_turn_rewards,
    token_advantages,
)
from flywheel.train.grouping import Group
from flywheel.train.packing import (
    MicroBatch,
    Row,
    TeacherTop,
    micro_batches,
    split_minibatches,
)
from flywheel.train.trainable_tokens import segment_sampling


def attribution(samples: list) -> dict[str, int]:
    """What the collector left out of these samples' trajectories, or kept out of their loss:
    retry orphans, turns the client never used, masked tokens by reason (flywheel/collect/lineage.py)."""
    counts: Counter[str] = Counter()
    for sample in samples:
        trajectory = sample.trajectory
        counts["retry_orphans"] += trajectory.retry_orphans
        counts["unused_turns"] += trajectory.unused_turns
        counts.update({f"{why}_tokens": n for why, n in trajectory.masked_tokens.items()})
    return dict(counts)


def hinted_spans(sample) -> list[tuple[int, int, int]]:
    """(segment, start, end) of each of a sample's turns that a teacher scored (a hint reached them)."""
    return [(k, start, end) for k, (segment, teacher) in enumerate(zip(sample.trajectory.segments, sample.teacher_logprobs))
            for _, start, end in segment.turn_spans if any(not math.isnan(v) for v in teacher[start:end])]


def hinted_turns(sample) -> int:
    """How many of a sample's turns a teacher scored."""
    return len(hinted_spans(sample))


def weigh_rl(values: list[list[float]], sample, actor) -> list[list[float]]:
    """The RL advantages of a sample's tokens times `actor.rl_coef`, on hinted turns times
    `actor.rl_coef_hinted` (when set), except on a practice reply whose reward checked it against
    the wish (`details["checked"]`, flywheel/judge/practice.py): that reward says what the hint's
    -1 does not, which of the group's replies did what was asked."""
    hinted = actor.rl_coef if actor.rl_coef_hinted is None else actor.rl_coef_hinted
    spans = hinted_spans(sample) if hinted != actor.rl_coef and not sample.details.get("checked") else []
    if actor.rl_coef == 1.0 and not spans:
        return values
    weights = [[actor.rl_coef] * len(segment) for segment in values]
    for k, start, end in spans:
        weights[k][start:end] = [hinted] * (end - start)
    return [[w * v for w, v in zip(ws, segment)] for ws, segment in zip(weights, values)]


def unjudged_positions(details: dict) -> set[int]:
    """The turns a judge could not judge (nothing followed them, no feedback about them: the
    `next_state` judge's `unjudged_turns`); in a composite, those every component left unjudged."""
    if "unjudged_turns" in details:
        return set(details["unjudged_turns"])
    components = [c.get("details") or {} for c in (details.get("components") or {}).values()]
    if components and all("unjudged_turns" in c for c in components):
        return set.intersection(*(set(c["unjudged_turns"]) for c in components))
    return set()


def exclude_unjudged(sample, sampling: list, excluded: Counter[str]) -> None:
    """Keep the sampled tokens of unjudged turns out of the loss (their 0.0 is a placeholder, not
    a score: never trained as one), counted as `unjudged` in `excluded`."""
    unjudged = unjudged_positions(sample.details)
    if not unjudged:
        return
    position = 0
    for segment, segment_sampling_ in zip(sample.trajectory.segments, sampling):
        for _, start, end in segment.turn_spans:
            if position in unjudged:
                mask = segment_sampling_.loss_mask
                excluded["unjudged"] += sum(mask[start:end])
                mask[start:end] = [0] * (end - start)
            position += 1


class StepBatch:
    def __init__(self, groups: list[Group], config: FlywheelConfig, baseline: RunningBaseline, pad_id: int):
        samples = [s for g in groups for s in g.samples]
        keys = [g.key for g in groups for _ in g.members]
        self.n_samples = len(samples)
        rewards = [s.reward for s in samples]
        self.reward_mean = fmean(rewards)
        self.turns_mean = fmean(len(s.trajectory.turns) for s in samples)
        self.threads_mean = fmean(len(set(s.trajectory.threads)) or 1 for s in samples)
        self.attribution = attribution(samples)
        self.hinted_turns = sum(hinted_turns(s) for s in samples)
        self.turns = sum(len(s.trajectory.turns) for s in samples)
        self.oldest_versions = [s.trajectory.oldest_version for s in samples]
        self.excluded: Counter[str] = Counter()
        actor = config.actor
        lora = config.adapters.kind == "lora"
        owners = [sample_adapter(s, config) if lora else None for s in samples]
        advantages = group_advantages(rewards, keys, baseline) if not lora else _per_adapter(rewards, keys, owners, baseline)
        self.advantage_abs_mean = fmean(map(abs, advantages))
        """How much the samples' rewards tell apart (0 for groups of equal rewards, as practice's by default)."""
        turn_rewards = [s.turn_rewards for s in samples]
        if actor.turn_reward_norm == "group" and actor.turn_reward_coef:
            turn_rewards = [r for g in groups for r in (group_turn_rewards(g.samples) if len(g.samples) > 1
                                                       else [s.turn_rewards for s in g.samples])]
        per_sample: list[list[Row]] = []
        for sample, advantage, rewards_of_turns in zip(samples, advantages, turn_rewards):
            values = token_advantages(sample, advantage, actor.turn_reward_coef, actor.turn_discount, rewards_of_turns)
            values = weigh_rl(values, sample, actor)
            sampling = segment_sampling(sample.trajectory, self.excluded, config.model)
            exclude_unjudged(sample, sampling, self.excluded)
            segments = sample.trajectory.segments
            teachers = sample.teacher_logprobs or [None] * len(segments)
            tops = ([TeacherTop(sample.teacher_top_k, ids, logprobs)
                     for ids, logprobs in zip(sample.teacher_top_ids, sample.teacher_top_logprobs)]
                    if sample.teacher_top_k and sample.teacher_top_ids else [None] * len(segments))
            per_sample.append([
                Row(segment, adv, s.temperatures, s.loss_mask, s.grammar, teacher, top)
                for segment, adv, s, teacher, top in zip(segments, values, sampling, teachers, tops)
            ])
        self.adapters: dict[str, str | None] = {}
        """The adapters the step trains, each with the adapter it starts from if it is new (`adapter_names.origin`)."""
        for name in owners:
            if name is not None and name not in self.adapters:
                self.adapters[name] = origin(name, config)
        # An adapter's samples are its own minibatches, packed apart (one adapter per micro-batch):
        # it takes the optimizer steps it would take alone.
        parts = [minibatches([rows for rows, a in zip(per_sample, owners) if a == name], config, pad_id, name)
                 for name in self.adapters] if lora else [minibatches(per_sample, config, pad_id)]
        self.minibatches: list[list[MicroBatch]] = [
            [b for part in parts if i < len(part) for b in part[i]] for i in range(max(map(len, parts)))
        ]


def minibatches(per_sample: list[list[Row]], config: FlywheelConfig, pad_id: int,
                adapter: str | None = None) -> list[list[MicroBatch]]:
    """Samples' rows as `actor.ppo_n_minibatches` minibatches of micro-batches, all of `adapter`."""
    out = []
    for rows in split_minibatches(per_sample, config.actor.ppo_n_minibatches):
        if rows:
            batches = micro_batches(rows, config.train.micro_batch_tokens, pad_id, config.train.packing)
            for batch in batches:
                batch.adapter = adapter
            out.append(batches)
    return out


def _per_adapter(rewards: list[float], keys: list[str], owners: list[str | None], baseline: RunningBaseline) -> list[float]:
    """Advantages with each adapter's own running baseline (`RunningBaseline.of`)."""
    advantages = [0.0] * len(rewards)
    for name in dict.fromkeys(owners):
        mine = [i for i, owner in enumerate(owners) if owner == name]
        values = group_advantages([rewards[i] for i in mine], [keys[i] for i in mine], baseline.of(str(name)))
        for i, value in zip(mine, values):
            advantages[i] = value
    return advantages
