"""The running batch of continuous batching: many sequences decoded together over one
preallocated KV cache.

Each layer's keys and values live in one tensor [row slots, kv heads, columns, head dim] that is
allocated once and only grows (doubling) when a row outgrows it, never per step. Row i of the
running batch is slot i (the live rows are always slots 0..n-1), and its tokens sit left-aligned
in columns 0..length-1: no left padding, no per-step concatenation. A decode step writes each
row's new key and value at its own column and attends over columns 0..max length with a mask
that hides, for shorter rows, the columns they have not reached.

- `prefill` runs new sequences with a throwaway cache: sorted by length and grouped so that
  little is padded (left padding within a group, so every row's last token is the same column)
  and returns their keys, values and last-token logits without touching the batch;
- `add` copies a prefill into the next free slots;
- `step` feeds one token per row and returns the next-token logits;
- `retain` keeps some rows: finished rows' slots are refilled from the tail (one row's copy per
  hole), and the new order is returned so the caller can reorder its own rows alike.

The allocation outlives an empty batch unless it grew (then it is given back). A slot taken by
a new row has what its last occupant wrote beyond the new row's tokens zeroed (masked columns
still take part in the attention product with weight 0, and 0 x NaN is NaN).

Each row's newest sampled token is not in the cache yet: it is the input of the next step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Cache, DynamicCache

from flywheel.models.lora_batch import Rows, applied
from flywheel.serve.engine.decode_graphs import DecodeGraphs
from flywheel.serve.engine.decoder import Decoder

PREFILL_TOKENS = 4096
"""A prefill forward holds at most this many positions (rows x longest row), unless one
sequence alone is longer."""
PREFILL_PADDING = 0.125
"""At most this share of a prefill group's positions is padding."""
ATTENTION_ROWS = 8
"""On a CPU, a decoder's step attends in spans of this many slots, each over its own longest
row's columns. On a GPU, where a step is bound by kernel launches rather than arithmetic
(docs/experiments/gpu-path.md), the whole batch is one span."""
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Attention (transformers' and the decoder's) on CUDA, without cuDNN's kernels: they plan each
new shape, and an engine's prefill groups and batch widths are new shapes all the time (a
bfloat16 engine on an H200 made 228 useful tok/s with them and 362 without, docs/experiments/gpu-path.md)."""


@dataclass
class Prefill:
    """New sequences run through the model, not yet in the batch."""

    keys: list[list[torch.Tensor]]
    """Per sequence, per layer [kv heads, its length, head dim]."""
    values: list[list[torch.Tensor]]
    logits: torch.Tensor
    """[sequences, vocab]: next-token logits after each sequence's last token."""

    @property
    def lengths(self) -> list[int]:
        return [layers[0].shape[1] for layers in self.keys]


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """The attention kernels a forward on `device` may use (`SDPA_BACKENDS` on CUDA)."""
    return sdpa_kernel(SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


class KVBatch(Cache):
    """The slots of the running batch, and the `Cache` the model writes a decode step into."""

    def __init__(self, model: torch.nn.Module, max_rows: int, first_columns: int = 256, attention_rows: int | None = None):
        super().__init__(layers=[])
        config = model.config
        self.layer_count = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self.attention_rows = attention_rows or (ATTENTION_ROWS if self.device.type == "cpu" else max_rows)
        self.max_rows = max_rows
        self.first_columns = first_columns
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        """[rows] tokens in the cache of each row (= the position id of its next input)."""
        self._write_rows: torch.Tensor | None = None
        self._write_columns: torch.Tensor | None = None
        self._step_width = 0
        self._written = 0
        """Columns some row has written since the allocation: beyond them every slot is zeros."""

    # ---- size ------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        """Allocated columns per row slot."""
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def cached_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def capacity_tokens(self) -> int:
        return self.max_rows * self.columns

    def _reserve(self, columns: int) -> None:
        """Make every slot hold at least `columns` tokens (doubling; existing rows are kept)."""
        if columns <= self.columns:
            return
        size = max(self.first_columns, self.columns)
        while size < columns:
            size *= 2
        shape = (self.max_rows, self.kv_heads, size, self.head_dim)
        used = self.columns
        for store in (self.keys, self.values):
            for layer in range(self.layer_count):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)  # masked, but 0 * NaN is NaN
                if used:
                    grown[: self.rows, :, :used] = store[layer][: self.rows]
                    store[layer] = grown
                else:
                    store.append(grown)

    def clear(self) -> None:
        """Drop every row. The first allocation is kept for the next rows; a grown one is given
        back."""
        if self.columns > self.first_columns:
            self.keys, self.values, self._written = [], [], 0
        self.lengths = self.lengths[:0]

    def _take_slot(self, row: int, length: int) -> None:
        """Zero what an earlier occupant of slot `row` left beyond `length`. Attention gives
        those columns weight 0, but 0 x NaN is NaN: a row whose keys or values were not finite
        must not reach the next one."""
        if self._written > length:
            for store in (self.keys, self.values):
                for layer in store:
                    layer[row, :, length:self._written] = 0

    # ---- prefill ---------------------------------------------------------------------------

    def prefill(self, model: torch.nn.Module, sequences: list[list[int]], pad_id: int, lora: Rows | None = None) -> Prefill:
        """Run `sequences` through the model (see the module docstring), sequence i with the adapter
        of `lora`'s row i, if any. The batch is not changed, so a prefill that raises leaves it as
        it was."""
        keys: list = [None] * len(sequences)
        values: list = [None] * len(sequences)
        logits: list = [None] * len(sequences)
        for group in _groups(sequences):
            width = max(len(sequences[i]) for i in group)
            input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(group), width), dtype=torch.long)
            for row, i in enumerate(group):
                input_ids[row, width - len(sequences[i]):] = torch.tensor(sequences[i])
                attention[row, width - len(sequences[i]):] = 1
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache()
            with attention_kernels(self.device), applied(lora and lora.subset(group)):
                out = model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                            position_ids=positions.to(self.device), past_key_values=cache, use_cache=True,
                            logits_to_keep=1)
            for row, i in enumerate(group):
                start = width - len(sequences[i])
                keys[i] = [layer.keys[row, :, start:] for layer in cache.layers]
                values[i] = [layer.values[row, :, start:] for layer in cache.layers]
                logits[i] = out.logits[row, -1]
        return Prefill(keys, values, torch.stack(logits))

    def add(self, prefill: Prefill) -> None:
        """Put the prefilled sequences in the next free slots (after the running rows)."""
        lengths = prefill.lengths
        first = self.rows
        if first + len(lengths) > self.max_rows:
            raise ValueError(f"{first} + {len(lengths)} rows exceed the batch's {self.max_rows} slots")
        self._reserve(max(lengths) + 1)
        for row, (keys, values, length) in enumerate(zip(prefill.keys, prefill.values, lengths), start=first):
            self._take_slot(row, length)
            for layer in range(self.layer_count):
                self.keys[layer][row, :, :length] = keys[layer]
                self.values[layer][row, :, :length] = values[layer]
        added = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self.lengths = torch.cat([self.lengths, added])
        self._written = max(self._written, *lengths)

    # ---- decode ----------------------------------------------------------------------------

    def step(self, model: torch.nn.Module, tokens: torch.Tensor, decoder: Decoder | None = None,
             lora: Rows | None = None, graphs: DecodeGraphs | None = None) -> torch.Tensor:
        """Feed one token per row [rows]; returns next-token logits [rows, vocab]. With `graphs`
        that serve these rows the step is replayed from a CUDA graph of the decoder's
        (`flywheel/serve/engine/decode_graphs.py`); else with a `decoder`
        (`flywheel/serve/engine/decoder.py`) it runs its forward, else transformers'; each row
        with the adapter of its row in `lora`, if any."""
        width = int(self.lengths.max()) + 1
        self._reserve(width)
        tokens = tokens.to(self.device)
        with attention_kernels(self.device):
            if graphs is not None and graphs.serves(lora):
                logits = graphs.step(tokens, self.lengths, lora)
            elif decoder is not None:
                logits = decoder.step(tokens, self.lengths, self.keys, self.values, self._spans(), lora)
            else:
                visible = torch.arange(width, device=self.device)[None, :] <= self.lengths[:, None]
                self._write_rows = torch.arange(self.rows, device=self.device)  # once per step, not per layer
                self._write_columns, self._step_width = self.lengths, width
                with applied(lora):
                    out = model(input_ids=tokens.unsqueeze(1), attention_mask=visible[:, None, None, :],
                                position_ids=self.lengths.unsqueeze(1), past_key_values=self, use_cache=True, logits_to_keep=1)
                self._write_rows = self._write_columns = None
                logits = out.logits[:, -1, :]
        self.lengths = self.lengths + 1
        self._written = max(self._written, width)
        return logits

    def _spans(self) -> list[tuple[int, int, torch.Tensor]]:
        """The step's attention spans: slots [start, end) and which of their first columns each
        row sees, [rows in span, that span's longest row + 1] (a short row pays for the longest of
        its span, not of the batch)."""
        lengths = self.lengths.tolist()
        spans = []
        for start in range(0, len(lengths), self.attention_rows):
            end = min(start + self.attention_rows, len(lengths))
            columns = torch.arange(max(lengths[start:end]) + 1, device=self.device)
            spans.append((start, end, columns[None, :] <= self.lengths[start:end, None]))
        return spans

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """`Cache.update`, called by each attention layer during `step`: store the step's key and
        value [rows, kv heads, 1, head dim] at each row's column; return the rows' keys and
        values up to the widest row."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self._write_rows, :, self._write_columns] = key_states[:, :, 0]
        values[self._write_rows, :, self._write_columns] = value_states[:, :, 0]
        return keys[: self.rows, :, : self._step_width], values[: self.rows, :, : self._step_width]

    # ---- leaving rows ----------------------------------------------------------------------

    def retain(self, keep: list[int]) -> list[int]:
        """Keep the rows `keep` (ascending) and drop the rest. Holes left by dropped rows below
        the new row count are filled with kept rows from the tail, so only those rows' caches
        move. Returns the new order: new row i is old row `order[i]`."""
        count = len(keep)
        order = list(range(self.rows))
        dropped = sorted(set(order) - set(keep))
        holes = [row for row in dropped if row < count]
        movers = [row for row in keep if row >= count]
        for hole, mover in zip(holes, movers):
            order[hole] = mover
            length = int(self.lengths[mover])
            self._take_slot(hole, length)
            for store in (self.keys, self.values):
                for layer in store:
                    layer[hole, :, :length] = layer[mover, :, :length]
        order = order[:count]
        if count == 0:
            self.clear()
        else:
            self.lengths = self.lengths[torch.tensor(order, device=self.device)]
        return order


def _groups(sequences: list[list[int]]) -> list[list[int]]:
    """Indices of `sequences` in prefill groups: sorted by length, a sequence joins the group of
    the shorter ones before it while the group stays within PREFILL_TOKENS positions and pads at
    most PREFILL_PADDING of them (a forward costs about the same per position from a few hundred
    positions up, so small groups lose little; padding is computed for nothing)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    groups: list[list[int]] = []
    real = 0
    for i in order:
        length = len(sequences[i])
        positions = (len(groups[-1]) + 1) * length if groups else 0
        if groups and positions <= PREFILL_TOKENS and positions - real - length <= PREFILL_PADDING * positions:
            groups[-1].append(i)
            real += length
        else:
            groups.append([i])
            real = length
    return groups
