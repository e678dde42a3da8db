"""Token tensors for a training step, built from samples' segments (exact sampled ids).

Each segment of each sample is one row, right-padded to the longest row. Position t of every
per-token tensor describes the token at t; the trainer predicts it from position t-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bus import Sample


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [rows, T] long
    attention_mask: torch.Tensor  # [rows, T] long
    loss_mask: torch.Tensor  # [rows, T] float, 1 on sampled tokens
    behav_logp: torch.Tensor  # [rows, T] float
    versions: torch.Tensor  # [rows, T] long, -1 off the mask
    advantages: torch.Tensor  # [rows, T] float

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def build_batch(samples: list[Sample], advantages: list[float], pad_id: int) -> TokenBatch:
    rows = [(seg, adv) for sample, adv in zip(samples, advantages) for seg in sample.trajectory.segments]
    width = max(len(seg.token_ids) for seg, _ in rows)
    shape = (len(rows), width)
    batch = TokenBatch(
        input_ids=torch.full(shape, pad_id, dtype=torch.long),
        attention_mask=torch.zeros(shape, dtype=torch.long),
        loss_mask=torch.zeros(shape),
        behav_logp=torch.zeros(shape),
        versions=torch.full(shape, -1, dtype=torch.long),
        advantages=torch.zeros(shape),
    )
    for i, (seg, adv) in enumerate(rows):
        n = len(seg.token_ids)
        batch.input_ids[i, :n] = torch.tensor(seg.token_ids)
        batch.attention_mask[i, :n] = 1
        batch.loss_mask[i, :n] = torch.tensor(seg.loss_mask, dtype=torch.float32)
        batch.behav_logp[i, :n] = torch.tensor(seg.logprobs)
        batch.versions[i, :n] = torch.tensor(seg.versions)
        batch.advantages[i, :n] = adv * batch.loss_mask[i, :n]
    # The first token has no prediction; it is never sampled, so its mask is already 0.
    return batch
