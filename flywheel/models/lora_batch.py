"""Many LoRA adapters in one batch: the adapters' matrices stacked into slots, and each row's
low-rank product beside the shared base product (what Punica's BGMV and S-LoRA's kernels do on
GPUs), in a few batched products per layer rather than one forward per adapter.

`AdapterTable` holds, for every linear layer of the model that some adapter adapts, A as
[slots + 1, in, r] and B as [slots + 1, r, out] (transposed from PEFT's layout, the scaling
folded into B). Slot 0 is the bare base and stays zero; an adapter written into slot s fills
A[s] and B[s]; adapters of lower rank than the table's `rank` are padded with zeros (they add
nothing), and a layer an adapter does not adapt stays zero in its slot. The rank grows when an
adapter of a higher rank is written (rounded up so that every slot starts on 16 bytes, as
`torch._grouped_mm` requires); the layers' stacks are allocated when a first adapter adapts them.

`AdapterTable.rows(slots)` describes one forward's rows (each its slot; None when every row is
the base: then nothing here runs at all) as `Rows`, which adds the rows' deltas
`(x A[slot]) B[slot]` to a layer's output:

- `add(out, x, layers)`: for the engine's own decode step (`flywheel/serve/engine/decoder.py`),
  whose products fuse several layers (q, k and v; gate and up): their deltas go to consecutive
  column ranges of `out`, the rows of `x` gathered once for all of them;
- `applied()`: for transformers' forward (prefill, chunked prefill, input scoring, decode of the
  models the decoder does not implement), forward hooks on the adapted layers, registered for
  the forward and removed after it; a row of a forward may hold many tokens (x [rows, seq, in]).

The rows that have an adapter are sorted by slot once per forward; with one adapter the deltas
are two plain products, with several one grouped product per matrix (`torch._grouped_mm`: each
slot's rows against its own A and B, slots without rows skipped). Measured once, per decode step
of SmolLM2-135M's 210 projections (float32, 32 rows spread evenly over 1, 8 or 32 adapters, 2
cores; the base products alone took ~51 ms unfused), at rank 8 / rank 32:

| deltas by | 1 adapter | 8 adapters | 32 adapters |
|---|---|---|---|
| each row's matrices gathered, two `bmm`s (vLLM's CPU path) | 34 / 102 ms | 40 / 136 ms | 55 / 180 ms |
| a loop over the adapters, plain products | 3 / 6 ms | 45 / 69 ms | 160 / 192 ms |
| grouped products (`torch._grouped_mm`) | 7 / 9 ms | 19 / 41 ms | 74 / 121 ms |

Hence plain products for one adapter, grouped products for more; and, while the table's slot
columns ((slots + 1) x rank) are at most `DENSE_COLUMNS`, two dense products over every token
instead, x [A_0 ... A_slots] masked to each token's own slot's columns, then times the stacked
B: no gathering, sorting or scattering, and no loop over slots (on the CPU `torch._grouped_mm`
is one small product per slot, empty ones included). Measured the same way at 32 slots: rank 8,
32 adapters 111 -> 53 ms, 8 adapters 52 -> 52 ms; at rank 32 (1,056 columns) dense was slower.

Either way a product reads the slots from 0 up to the highest its forward uses, as views of the
stacks (no copies), and the engine fills the lowest free slot first: 8 adapters resident in a
table of 32 slots cost what they cost in a table of 8. Measured the same way (`bench/adapter_profile.py`,
two runs each, alternating): 8 adapters at rank 8 41-47 -> 17-18 ms, at rank 32 70-80 -> 53-62
ms (dense now: 9 slots of rank 32 are 288 columns). Gathering just the forward's slots for each
product (`index_select`, every layer, every step) was tried first: no faster at rank 8 (41-43
ms), slower at rank 32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from flywheel.models.lora_adapter import AdapterError, LoraAdapter

DENSE_COLUMNS = {"cpu": 512, "cuda": 8192}
"""By the table's device type: up to this many slot columns ((slots + 1) x rank), several
adapters' deltas are two dense products over every token (see the module docstring); above (and
on other devices), grouped products. CPU: `bench/adapter_profile.py`, 32 slots, rank 32: 1,056
columns, dense 245 / 194 ms a step against grouped 91 / 178 ms with 8 / 32 adapters. CUDA: a decode
step is launch-bound and the dense products are a few small kernels, while `torch._grouped_mm` in
float32 (CUTLASS's kernels are bfloat16's) loops over the slots on the host after a device sync
(benchmarks, adapters on a GPU: 32 adapters of rank 32 at 0.11x of base-only)."""
DENSE_TOKENS = 64
"""And for forwards of at most this many tokens (decode steps: measured there; a long prefill
would pay every slot's A product on every token)."""


@dataclass
class LowRank:
    """One linear layer's stacked adapter matrices."""

    flat: torch.Tensor
    """A as [in, slots + 1, rank]: `x @ flat.view(in, -1)` is every slot's x A at once."""
    b: torch.Tensor
    """[slots + 1, rank, out]"""

    @property
    def a(self) -> torch.Tensor:
        """A as [slots + 1, in, rank] (a view of `flat`)."""
        return self.flat.permute(1, 0, 2)


class AdapterTable:
    """The resident adapters' matrices of one model, a slot each (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, slots: int):
        self.slots = slots
        output = model.get_output_embeddings()
        self.layers: dict[str, torch.nn.Linear] = {
            name: module for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and module is not output}
        """The layers an adapter may adapt: the model's linear layers but its output head."""
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        self._align = max(1, 16 // parameter.element_size())
        """Elements in 16 bytes: ranks are rounded up to it, features must be multiples of it."""
        self.rank = 0
        self.low_rank: dict[torch.nn.Module, LowRank] = {}
        """The adapted layers' stacks, by layer."""

    def check(self, adapter: LoraAdapter) -> None:
        """Raise `AdapterError` unless every layer `adapter` adapts is one of this model's
        adaptable layers, with its shapes (whose rows start on 16 bytes: grouped products need it)."""
        for name, (a, b) in adapter.layers.items():
            layer = self.layers.get(name)
            if layer is None:
                raise AdapterError(f"{adapter.path}: {name} is not a linear layer of this model that adapters may adapt "
                                   "(the output head and embeddings are not)")
            if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
                raise AdapterError(f"{adapter.path}: {name} maps {a.shape[1]} to {b.shape[0]} features; the model's "
                                   f"layer maps {layer.in_features} to {layer.out_features}")
            if layer.in_features % self._align or layer.out_features % self._align:
                raise AdapterError(f"{adapter.path}: {name}'s features ({layer.in_features}, {layer.out_features}) are not "
                                   f"multiples of {self._align}, as batched adapter products need")

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` (checked) into `slot` (1..slots), replacing what was there."""
        if not 1 <= slot <= self.slots:
            raise ValueError(f"slot {slot} is not in 1..{self.slots}")
        self._fit(adapter.rank)
        for stacks in self.low_rank.values():
            stacks.flat[:, slot] = 0
            stacks.b[slot] = 0
        for name, (a, b) in adapter.layers.items():
            stacks = self.low_rank.get(self.layers[name]) or self._allocate(self.layers[name])
            rank = a.shape[0]
            stacks.flat[:, slot, :rank] = a.T.to(self.dtype)
            stacks.b[slot, :rank] = b.T.to(self.dtype)

    def rows(self, slots: Sequence[int]) -> Rows | None:
        """One forward's rows, row i of which uses `slots[i]`; None when none uses an adapter."""
        return Rows(self, list(slots)) if any(slots) else None

    def _fit(self, rank: int) -> None:
        """Grow every stack's rank to hold `rank` (rounded up to 16 bytes), keeping what is written."""
        rank = -(-rank // self._align) * self._align
        if rank <= self.rank:
            return
        for stacks in self.low_rank.values():
            flat, b = stacks.flat, stacks.b
            stacks.flat = flat.new_zeros(flat.shape[0], flat.shape[1], rank)
            stacks.flat[:, :, :self.rank] = flat
            stacks.b = b.new_zeros(b.shape[0], rank, b.shape[2])
            stacks.b[:, :self.rank] = b
        self.rank = rank

    def _allocate(self, layer: torch.nn.Linear) -> LowRank:
        zeros = dict(dtype=self.dtype, device=self.device)
        stacks = LowRank(torch.zeros(layer.in_features, self.slots + 1, self.rank, **zeros),
                         torch.zeros(self.slots + 1, self.rank, layer.out_features, **zeros))
        self.low_rank[layer] = stacks
        return stacks


class Rows:
    """The rows of one forward and their slots in an `AdapterTable` (see the module docstring)."""

    def __init__(self, table: AdapterTable, slots: list[int]):
        self.table = table
        self.slots = slots
        self._plans: dict[int, _Plan] = {}

    def subset(self, indices: Sequence[int]) -> Rows | None:
        """Rows `indices` of these, as the rows of a forward of their own."""
        return self.table.rows([self.slots[i] for i in indices])

    def add(self, out: torch.Tensor, x: torch.Tensor, layers: Sequence[torch.nn.Linear]) -> None:
        """Add to `out` [tokens, sum of the layers' out features] the rows' deltas of `layers`
        (whose inputs are all `x` [tokens, in]), each layer's to its own range of columns."""
        plan = self._plan(len(x))
        picked = x if plan.identity else x[plan.order]
        column = 0
        for layer in layers:
            stacks = self.table.low_rank.get(layer)
            width = layer.out_features
            if stacks is not None:
                target = out[:, column:column + width]
                if plan.identity:
                    plan.accumulate(target, picked, stacks)
                else:
                    target.index_add_(0, plan.order, plan.product(picked, stacks))
            column += width

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """During the block, the adapted layers add the rows' deltas to their outputs (transformers'
        forward, whose batch rows are these rows, each of one or more tokens)."""
        handles = [layer.register_forward_hook(self._hook) for layer in self.table.low_rank]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, layer: torch.nn.Linear, args: tuple, output: torch.Tensor) -> None:
        self.add(output.view(-1, layer.out_features), args[0].reshape(-1, layer.in_features), (layer,))

    def _plan(self, tokens: int) -> _Plan:
        if tokens not in self._plans:
            if tokens % len(self.slots):
                raise ValueError(f"{tokens} tokens are not {len(self.slots)} rows of equal length")
            slots = torch.tensor(self.slots, device=self.table.device).repeat_interleave(tokens // len(self.slots))
            self._plans[tokens] = _Plan(slots, self.table)
        return self._plans[tokens]


def applied(rows: Rows | None) -> contextlib.AbstractContextManager:
    """`rows.applied()`, or nothing to do when there are no adapter rows."""
    return contextlib.nullcontext() if rows is None else rows.applied()


class _Plan:
    """A forward's tokens that have an adapter, sorted by slot, for one token count."""

    def __init__(self, slots: torch.Tensor, table: AdapterTable):
        adapted = int((slots > 0).sum())
        self.order = torch.argsort(slots, stable=True)[len(slots) - adapted:]
        """The adapted tokens' indices, by slot."""
        distinct = torch.unique(slots[self.order])
        self.single = int(distinct[0]) if len(distinct) == 1 else None
        """The slot, when all adapted tokens use one."""
        self.width = int(distinct[-1]) + 1
        """The slots a product reads: 0 up to the highest this forward uses (views, no copies: a
        forward of 8 adapters in a table of 32 slots that holds them in its first 8 reads 9)."""
        self.foreign: torch.Tensor | None = None
        """With several adapters, at most `DENSE_COLUMNS` columns read and `DENSE_TOKENS` tokens:
        [tokens, width * rank], True but where a token's own slot's columns are (slot 0, the
        base's, is zero anyway); those are cleared, not multiplied by 0, so that no slot's inf or
        NaN reaches another's rows."""
        dense = DENSE_COLUMNS.get(table.device.type, 0)
        if self.single is None and self.width * table.rank <= dense and len(slots) <= DENSE_TOKENS:
            mask = torch.zeros(len(slots), self.width, table.rank, dtype=torch.bool, device=table.device)
            mask[torch.arange(len(slots), device=slots.device), slots] = True
            self.foreign = ~mask.view(len(slots), -1)
        self.identity = self.foreign is not None or (adapted == len(slots) and self.single is not None)
        """Whether every token is computed in place (no gathering, no scattering): all use one
        slot, or the dense products run on every token."""
        counts = torch.bincount(slots[self.order], minlength=self.width)
        self.ends = counts.cumsum(0).to(torch.int32)
        """Per slot, where its tokens end in `order` (`torch._grouped_mm`'s offsets)."""

    def product(self, x: torch.Tensor, stacks: LowRank) -> torch.Tensor:
        """(x A[slot]) B[slot] for the adapted tokens `x` [adapted tokens, in], in `order`."""
        if self.single is not None:
            return x @ stacks.a[self.single] @ stacks.b[self.single]
        b = stacks.b[:self.width]
        return torch._grouped_mm(torch._grouped_mm(x, stacks.a[:self.width], offs=self.ends), b, offs=self.ends)

    def accumulate(self, out: torch.Tensor, x: torch.Tensor, stacks: LowRank) -> None:
        """out += (x A[slot]) B[slot] for every token (an `identity` plan), the second product
        accumulating in place (`addmm_`, no delta tensor and no separate add)."""
        if self.single is not None:
            out.addmm_(x @ stacks.a[self.single], stacks.b[self.single])
            return
        every = x @ stacks.flat[:, :self.width].flatten(1)  # a view: each row of A strided by the table's width
        out.addmm_(every.masked_fill_(self.foreign, 0), stacks.b[:self.width].flatten(0, 1))
