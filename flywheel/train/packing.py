"""Micro-batches of token rows for a training step, built from samples' segments (the exact
sampled ids), packed or padded.

A step's samples are split into micro-batches of at most `train.micro_batch_tokens` computed
tokens; the trainer accumulates gradients over them and steps once.

- **Packed** (default): segments go first-fit-decreasing into rows as long as the step's
  longest segment, and as many rows as fit the budget make a micro-batch. Each segment restarts
  its position ids; with no attention mask, transformers derives block-diagonal causal
  attention from the position ids, so no segment sees another, and only the ends of rows that
  no segment fills are padding. Rows are no longer than the longest segment because attention
  without a variable-length kernel costs the square of the row length (one row of the whole
  budget was 2x slower than padding on CPU: bench/trainer_efficiency.py).
- **Padded** (`train.packing: false`): one segment per row, rows right-padded to the longest of
  their micro-batch, micro-batches filled in arrival order while rows × width fits the budget:
  what a plain padded loop computes, kept to measure what packing saves.

A segment longer than the budget gets a micro-batch of its own. Position t of every per-token
tensor describes the token at t, which the trainer predicts from t − 1; the first token of a
segment has no prediction, and it is a prompt token (mask 0), so packing loses nothing there.

Tokens drawn under a grammar (`flywheel/train/trainable_tokens.py`) are listed apart: their (row, column) and the
bitmask of the tokens allowed there, one row per token (vocab / 8 bytes each), not a mask over
every position.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from flywheel.bus import Segment

_TORCH_DTYPES = {"i": torch.int32, "d": torch.float64, "b": torch.int8}


def as_tensor(values: array.array) -> torch.Tensor:
    """A tensor over a bus array's memory (no copy); a copy into a batch slot converts dtype."""
    dtype = _TORCH_DTYPES[values.typecode]
    return torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)


@dataclass
class GrammarMasks:
    """The loss tokens of a segment that were drawn under a grammar: their positions and, one row
    each, llguidance's bitmask of the tokens the grammar allowed there ([n, words] int32,
    `flywheel/formats/grammar.py`)."""

    positions: list[int]
    allowed: torch.Tensor


@dataclass
class TeacherTop:
    """A segment's `Sample.teacher_top_ids` / `teacher_top_logprobs`: `k` per token, token t's at
    [t·k, (t+1)·k), id -1 where no teacher spoke."""

    k: int
    ids: array.array
    logprobs: array.array


@dataclass
class Row:
    """One segment with, per token, its advantage, the temperature it was sampled at, and
    whether it counts in the loss (the segment's mask without excluded tokens, see
    `flywheel/train/trainable_tokens.py`), and the tokens drawn under a grammar. Without the last three:
    temperature 1, the segment's own mask, no grammar."""

    segment: Segment
    advantages: list[float]
    temperatures: list[float] | None = None
    loss_mask: list[int] | None = None
    grammar: GrammarMasks | None = None
    teacher_logprobs: array.array | None = None
    """A teacher's log-probability of each token (NaN where it gave none): hint distillation."""
    teacher_top: "TeacherTop | None" = None
    """A teacher's likeliest tokens at each position, for dense hint distillation."""

    def __len__(self) -> int:
        return len(self.segment.token_ids)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [rows, T] long
    position_ids: torch.Tensor  # [rows, T] long; restarting at each packed segment
    attention_mask: torch.Tensor | None  # [rows, T] long for padded rows; None when packed
    loss_mask: torch.Tensor  # [rows, T] float, 1 on sampled tokens that count in the loss
    behav_logp: torch.Tensor  # [rows, T] float
    temperatures: torch.Tensor  # [rows, T] float, the temperature each token was sampled at
    versions: torch.Tensor  # [rows, T] long, -1 off the mask
    advantages: torch.Tensor  # [rows, T] float
    grammar_at: torch.Tensor  # [n, 2] long: (row, column) of each loss token drawn under a grammar
    grammar_allowed: torch.Tensor  # [n, words] int32: the bitmask of the tokens allowed there
    teacher_logp: torch.Tensor  # [rows, T] float, NaN where no teacher scored the token
    teacher_top_ids: torch.Tensor  # [rows, T, k] long, the teacher's likeliest tokens at t; -1 where none
    teacher_top_logp: torch.Tensor  # [rows, T, k] float, their teacher log-probabilities
    real_tokens: int
    """Tokens that belong to a segment (the rest is padding)."""
    adapter: str | None = None
    """The LoRA adapter all its rows train (`adapters.kind: lora`); None: the shared weights."""

    @property
    def computed_tokens(self) -> int:
        return self.input_ids.numel()


def _tensors(lines: list[list[Row]], width: int, pad_id: int, packed: bool) -> MicroBatch:
    shape = (len(lines), width)
    k = max((row.teacher_top.k for line in lines for row in line if row.teacher_top is not None), default=0)
    batch = MicroBatch(
        input_ids=torch.full(shape, pad_id, dtype=torch.long),
        position_ids=torch.zeros(shape, dtype=torch.long),
        attention_mask=None if packed else torch.zeros(shape, dtype=torch.long),
        loss_mask=torch.zeros(shape),
        behav_logp=torch.zeros(shape),
        temperatures=torch.ones(shape),
        versions=torch.full(shape, -1, dtype=torch.long),
        advantages=torch.zeros(shape),
        grammar_at=torch.zeros((0, 2), dtype=torch.long),
        grammar_allowed=torch.zeros((0, 0), dtype=torch.int32),
        teacher_logp=torch.full(shape, float("nan")),
        teacher_top_ids=torch.full((*shape, k), -1, dtype=torch.long),
        teacher_top_logp=torch.full((*shape, k), float("nan")),
        real_tokens=sum(len(row) for line in lines for row in line),
    )
    grammar_at: list[tuple[int, int]] = []
    allowed: list[torch.Tensor] = []
    for i, line in enumerate(lines):
        at = 0
        for row in line:
            seg, end = row.segment, at + len(row)
            batch.input_ids[i, at:end] = as_tensor(seg.token_ids)
            batch.position_ids[i, at:end] = torch.arange(len(row))
            batch.loss_mask[i, at:end] = as_tensor(seg.loss_mask) if row.loss_mask is None else torch.tensor(row.loss_mask)
            if row.temperatures is not None:
                batch.temperatures[i, at:end] = torch.tensor(row.temperatures)
            batch.behav_logp[i, at:end] = as_tensor(seg.logprobs)
            batch.versions[i, at:end] = as_tensor(seg.versions)
            batch.advantages[i, at:end] = torch.tensor(row.advantages)
            if row.teacher_logprobs is not None:
                batch.teacher_logp[i, at:end] = as_tensor(row.teacher_logprobs)
            if row.teacher_top is not None and row.teacher_top.k == k:  # one teacher setting per step
                batch.teacher_top_ids[i, at:end] = as_tensor(row.teacher_top.ids).view(len(row), k)
                batch.teacher_top_logp[i, at:end] = as_tensor(row.teacher_top.logprobs).view(len(row), k)
            if batch.attention_mask is not None:
                batch.attention_mask[i, at:end] = 1
            if row.grammar is not None:
                grammar_at += [(i, at + p) for p in row.grammar.positions]
                allowed.append(row.grammar.allowed)
            at = end
        if packed:  # padding at the end of a row: a sequence of its own, off the loss mask
            batch.position_ids[i, at:] = torch.arange(width - at)
    if grammar_at:
        batch.grammar_at, batch.grammar_allowed = torch.tensor(grammar_at, dtype=torch.long), torch.cat(allowed)
    return batch


def pack(rows: list[Row], budget: int, pad_id: int) -> list[MicroBatch]:
    """First-fit-decreasing into rows as long as the longest segment; rows grouped into
    micro-batches of at most `budget` tokens."""
    width = max(map(len, rows))
    lines: list[list[Row]] = []
    space: list[int] = []
    for row in sorted(rows, key=len, reverse=True):
        for i, free in enumerate(space):
            if len(row) <= free:
                lines[i].append(row)
                space[i] -= len(row)
                break
        else:
            lines.append([row])
            space.append(width - len(row))
    per_batch = max(1, budget // width)
    groups = [lines[i:i + per_batch] for i in range(0, len(lines), per_batch)]
    return [_tensors(group, max(sum(map(len, line)) for line in group), pad_id, packed=True) for group in groups]


def pad(rows: list[Row], budget: int, pad_id: int) -> list[MicroBatch]:
    """One right-padded row per segment, in arrival order, while rows × width fits `budget`."""
    groups: list[list[Row]] = []
    for row in rows:
        group = groups[-1] if groups else None
        if group is None or (len(group) + 1) * max(len(row), *map(len, group)) > budget:
            groups.append([row])
        else:
            group.append(row)
    return [_tensors([[row] for row in group], max(map(len, group)), pad_id, packed=False) for group in groups]


def micro_batches(rows: list[Row], budget: int, pad_id: int, packing: bool = True) -> list[MicroBatch]:
    return (pack if packing else pad)(rows, budget, pad_id)


def split_minibatches(rows: list[list[Row]], n: int) -> list[list[Row]]:
    """Split samples (each a list of rows) into `n` minibatches of about equal token counts,
    keeping each sample whole (fewer minibatches when there are fewer samples): the largest
    sample goes to the lightest minibatch, in turn."""
    n = max(1, min(n, len(rows)))
    bins: list[list[Row]] = [[] for _ in range(n)]
    loads = [0] * n
    for sample in sorted(rows, key=lambda rs: sum(map(len, rs)), reverse=True):
        lightest = loads.index(min(loads))
        bins[lightest].extend(sample)
        loads[lightest] += sum(map(len, sample))
    return bins
