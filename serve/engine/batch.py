"""The running batch of continuous batching: many sequences decoded together over one KV cache.

All rows end at the same column of a shared `DynamicCache`: a row shorter than the longest is
left-padded (attention mask 0), and each row carries its own position ids. So every decode step
is one forward pass of the model on a [rows, 1] batch, and rows can come and go between steps:

- `prefill` runs new sequences (left-padded among themselves) and returns a batch of them;
- `merge` pads the shorter of two batches on the left to the same width and stacks them;
- `select` keeps some rows (finished ones leave) and trims padding no row needs any more.

Each row's newest sampled token is not in the cache yet: it is the input of the next step.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class KVBatch:
    def __init__(self, cache: DynamicCache, attention: torch.Tensor, positions: torch.Tensor):
        self.cache = cache
        self.attention = attention
        """[rows, width] 1 where the cache holds a real token of that row."""
        self.positions = positions
        """[rows] position id of each row's next input token (= its real length so far)."""

    @property
    def rows(self) -> int:
        return self.attention.shape[0]

    @property
    def width(self) -> int:
        return self.attention.shape[1]

    @property
    def cached_tokens(self) -> int:
        """Real tokens held in the cache, over all rows."""
        return int(self.attention.sum())

    @classmethod
    def prefill(cls, model: torch.nn.Module, sequences: list[list[int]], pad_id: int) -> tuple["KVBatch", torch.Tensor]:
        """Run `sequences` through the model; returns the batch and the logits [rows, vocab] of
        each sequence's last token."""
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, seq in enumerate(sequences):
            input_ids[i, width - len(seq):] = torch.tensor(seq)
            attention[i, width - len(seq):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = _forward(model, input_ids, attention, positions, cache)
        return cls(cache, attention, attention.sum(-1)), logits

    def step(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [rows]; returns next-token logits [rows, vocab]."""
        self.attention = torch.cat([self.attention, torch.ones((self.rows, 1), dtype=torch.long)], dim=1)
        logits = _forward(model, tokens.unsqueeze(1), self.attention, self.positions.unsqueeze(1), self.cache)
        self.positions = self.positions + 1
        return logits

    def merge(self, other: "KVBatch") -> "KVBatch":
        """This batch's rows followed by `other`'s, in one cache (both are consumed)."""
        width = max(self.width, other.width)
        self._pad_to(width)
        other._pad_to(width)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.attention = torch.cat([self.attention, other.attention])
        self.positions = torch.cat([self.positions, other.positions])
        return self

    def _pad_to(self, width: int) -> None:
        extra = width - self.width
        if extra == 0:
            return
        for layer in self.cache.layers:
            layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, extra, 0))
            layer.values = torch.nn.functional.pad(layer.values, (0, 0, extra, 0))
        self.attention = torch.nn.functional.pad(self.attention, (extra, 0))

    def select(self, keep: list[int]) -> "KVBatch | None":
        """The batch of rows `keep` (None if empty), without padding columns nobody uses."""
        if not keep:
            return None
        if len(keep) < self.rows:
            index = torch.tensor(keep)
            self.attention = self.attention[index]
            self.positions = self.positions[index]
            for layer in self.cache.layers:
                layer.keys = layer.keys[index]
                layer.values = layer.values[index]
        used = self.attention.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else self.width
        if first > 0:
            self.attention = self.attention[:, first:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]
        return self


def _forward(model, input_ids, attention, positions, cache) -> torch.Tensor:
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :]
