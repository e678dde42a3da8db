"""Many LoRA adapters in one batch: the adapters' matrices stacked into slots, and each row's
low-rank product beside the shared base product (what Punica's BGMV and S-LoRA's kernels do on
GPUs), in a few batched products per layer rather than one forward per adapter.

`AdapterTable` holds, for every linear layer of the model that some adapter adapts, A as [slots + 1,
in, r] and B as [slots + 1, r, out] (B transposed from PEFT's layout, the scaling folded into it; A
a transposed view of PEFT's [r, in] rows, below). Slot 0 is the bare base and stays zero; an adapter
written into slot s fills A[s] and B[s]; adapters of lower rank than the table's `rank` are padded
with zeros (they add nothing), and a layer an adapter does not adapt stays zero in its slot. The
rank grows when an adapter of a higher rank is written (rounded up so that every slot starts on 16
bytes, as `torch._grouped_mm` requires); the layers' stacks are allocated when a first adapter
adapts them.

`AdapterTable.rows(slots)` describes one forward's rows (each its slot; None when every row is
the base: then nothing here runs at all) as `Rows`, which adds the rows' deltas
`(x A[slot]) B[slot]` to a layer's output:

- `add(out, x, layers)`: for the engine's own decode step (`flywheel/serve/engine/decoder.py`),
  whose products fuse several layers (q, k and v; gate and up): their deltas go to consecutive
  column ranges of `out`, the rows of `x` gathered once for all of them;
- `applied()`: for transformers' forward (prefill, chunked prefill, input scoring, decode of the
  models the decoder does not implement), forward hooks on the adapted layers, registered for
  the forward and removed after it; a row of a forward may hold many tokens (x [rows, seq, in]).

`AdapterTable.fixed_rows(slots)` (`FixedRows`) is a decode step's rows whose slots are a tensor
on the device, for a step captured as a CUDA graph (`flywheel/serve/engine/decode_graphs.py`):
the dense products over every slot, nothing read back to the host, no shape that depends on the
slots used.

The rows that have an adapter are sorted by slot once per forward. With one adapter the deltas
are two plain products. With several, two batched products over the slots (`torch.bmm`, the
padded products): each slot's tokens padded to the most any slot has, so that every product is
a slot's own A or B against its own tokens; the slots read in place, or gathered where the used
ones are spread out (`PADDED_SPREAD`). Where padding would be most of the work (uneven prefills,
`PADDED_WASTE`), one grouped product per matrix instead (`torch._grouped_mm`: each slot's rows
against its own A and B; on the CPU a loop of one small product per slot, empty slots
included). On CUDA, in a decode step, while the slot columns ((slots + 1) x rank) are at most
`DENSE_COLUMNS`, two dense products over every token (below). Where every row has an adapter
and holds many tokens (a prefill's forward: `ROW_TOKENS`, `ROW_RANKS`), each row's tokens take its
own slot's A and B, gathered a row each, in place: a row's matrices are fewer bytes to move than
its tokens, which the padded products gather, multiply and gather back.

Why these products, measured on this machine and a GPU (a loop over the adapters, each row's
matrices gathered as vLLM's CPU path does, grouped, dense, padded, by row; A's layout; which slots
a product reads): docs/experiments/adapters.md, "How the batched products were chosen".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from flywheel.models.lora_adapter import AdapterError, LoraAdapter

PADDED_SPREAD = 2
"""The padded products read the slots from 1 to the highest a forward uses, as views; where those
are more than this many times the slots it uses (idle adapters resident between them), the used
slots' matrices gathered instead. `bench/adapter_profile.py`'s step, 32 rows over 8 adapters in
slots 4, 8, ..., 32, rank 32: the range 89 ms, grouped products 62-64, gathered 36-38 (rank 8:
37, 38 and 17 ms); the engine had put 8 of 32 loaded adapters in slots 1-3, 15, 21, 22, 28, 29."""
PADDED_WASTE = 2
"""The padded products' places (slots read x the most tokens a slot has) at most this many
times the adapted tokens; else (uneven prefills) grouped products."""
DENSE_COLUMNS = {"cuda": 8192}
"""By the table's device type: up to this many slot columns ((slots + 1) x rank), a decode step's
(`DENSE_TOKENS`) several adapters take the dense products; elsewhere the padded ones. CUDA: a
decode step is launch-bound, and the dense products are 3 kernels a layer (the padded 4, and one
more a fused product); `torch._grouped_mm` in float32 loops over the slots on the host after a device sync
(adapters on a GPU: 32 adapters of rank 32 at 0.11x of base-only with it, 0.60x dense). The
padded products were not measured on a GPU. CPU: the padded products (module docstring)."""
ROW_TOKENS = 8
"""The fewest tokens a row of a forward holds for the products by row (`ROW_RANKS`)."""
ROW_RANKS = 2
"""Where every row of a forward has an adapter and holds at least `ROW_TOKENS` tokens and
`ROW_RANKS` times the table's rank (a prefill's), each row's tokens take its slot's A and B
gathered, in place (`_Plan.row_slots`): no token is gathered or scattered, and a row's matrices
are fewer bytes than its tokens' (module docstring)."""
DENSE_TOKENS = 64
"""The dense products only in forwards of at most this many tokens (decode steps): in a prefill
every token would pay every slot's columns."""


@dataclass
class LowRank:
    """One linear layer's stacked adapter matrices."""

    a: torch.Tensor
    """[slots + 1, in, rank]: each slot's A one contiguous matrix stored [rank, in] and seen
    transposed, or a view of `flat`."""
    b: torch.Tensor
    """[slots + 1, rank, out]"""
    flat: torch.Tensor | None = None
    """Where the dense products run: A kept as [in, slots + 1, rank], so that `x @ flat.view(in,
    -1)` is every slot's x A at once."""


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
        self.dense_columns = DENSE_COLUMNS.get(self.device.type, 0)
        """Up to how many slot columns a decode step takes the dense products (0: never)."""
        self.rank = 0
        self.low_rank: dict[torch.nn.Module, LowRank] = {}
        """The adapted layers' stacks, by layer."""
        self.generation = 0
        """Counts the times the stacks are allocated anew (a layer's first adapter, a higher rank),
        bumped before they change: what holds their tensors (a captured CUDA graph) must take them
        again. Writing a slot writes in place."""

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
        adapted = {self.layers[name]: pair for name, pair in adapter.layers.items()}
        for layer in adapted:
            if layer not in self.low_rank:  # a layer's first adapter
                self.generation += 1
                self.low_rank[layer] = self._zeros(layer, self.rank)
        for layer, stacks in self.low_rank.items():  # on the engine's thread between two steps: few ops
            a, b = adapted.get(layer, (None, None))
            rank = 0 if a is None else a.shape[0]
            if rank:
                stacks.a[slot, :, :rank] = a.T.to(self.dtype)
                stacks.b[slot, :rank] = b.T.to(self.dtype)
            if rank < self.rank:
                stacks.a[slot, :, rank:] = 0
                stacks.b[slot, rank:] = 0

    def rows(self, slots: Sequence[int]) -> Rows | None:
        """One forward's rows, row i of which uses `slots[i]`; None when none uses an adapter."""
        return Rows(self, list(slots)) if any(slots) else None

    @property
    def fixed_fits(self) -> bool:
        """Whether `fixed_rows` serves this table: the dense products over every slot's columns."""
        return 0 < (self.slots + 1) * self.rank <= self.dense_columns

    def fixed_rows(self, slots: torch.Tensor) -> FixedRows:
        """The rows of a decode step whose slots are `slots` [rows] on the table's device (`FixedRows`)."""
        return FixedRows(self, slots)

    def _fit(self, rank: int) -> None:
        """Grow every stack's rank to hold `rank` (rounded up to 16 bytes), keeping what is written."""
        rank = -(-rank // self._align) * self._align
        if rank <= self.rank:
            return
        self.generation += 1  # before the stacks change: one that raises half-way leaves no graph on them
        for layer, old in self.low_rank.items():
            new = self.low_rank[layer] = self._zeros(layer, rank)
            new.a[:, :, :self.rank] = old.a
            new.b[:, :self.rank] = old.b
        self.rank = rank

    def _zeros(self, layer: torch.nn.Linear, rank: int) -> LowRank:
        like = dict(dtype=self.dtype, device=self.device)
        b = torch.zeros(self.slots + 1, rank, layer.out_features, **like)
        if not self.dense_columns:  # each slot's A stored [rank, in] (PEFT's own layout), used transposed
            return LowRank(torch.zeros(self.slots + 1, rank, layer.in_features, **like).transpose(1, 2), b)
        flat = torch.zeros(layer.in_features, self.slots + 1, rank, **like)
        return LowRank(flat.permute(1, 0, 2), b, flat)


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
        _add_deltas(self._plan(len(x)), self.table, out, x, layers)

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
            self._plans[tokens] = _Plan(slots, self.table, len(self.slots))
        return self._plans[tokens]


class FixedRows:
    """The rows of a decode step (one token each) whose slots are a tensor on the table's device,
    read only there: every token takes the dense products over all of the table's slots, its own
    slot's columns picked by a mask made on the device. Nothing is read back to the host and no
    shape depends on which slots are used, so a CUDA graph captured over them replays for any
    slots written into the same tensor (`flywheel/serve/engine/decode_graphs.py`). Only where
    the table `fixed_fits`."""

    def __init__(self, table: AdapterTable, slots: torch.Tensor):
        self.table = table
        self.width = table.slots + 1
        columns = torch.arange(self.width * table.rank, device=slots.device) // table.rank  # each column's slot
        self.foreign = columns[None, :] != slots[:, None]
        """[tokens, every slot's columns]: True but where a token's own slot's columns are."""

    def add(self, out: torch.Tensor, x: torch.Tensor, layers: Sequence[torch.nn.Linear]) -> None:
        """As `Rows.add`."""
        _add_deltas(self, self.table, out, x, layers)

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_one(self, out: torch.Tensor, x: torch.Tensor, stacks: LowRank) -> None:
        _add_dense(out, x, stacks, self.width, self.foreign)


def _add_deltas(plan: _Plan | FixedRows, table: AdapterTable, out: torch.Tensor, x: torch.Tensor,
                layers: Sequence[torch.nn.Linear]) -> None:
    """`Rows.add` by `plan`: the tokens picked once, each adapted layer's deltas to its columns."""
    picked = plan.pick(x)
    column = 0
    for layer in layers:
        stacks = table.low_rank.get(layer)
        if stacks is not None:
            plan.add_one(out[:, column:column + layer.out_features], picked, stacks)
        column += layer.out_features


def _add_dense(out: torch.Tensor, x: torch.Tensor, stacks: LowRank, width: int, foreign: torch.Tensor) -> None:
    """out += each token's (x A[slot]) B[slot] by the dense products over slots 0..width - 1: x
    times every slot's A, the columns of other slots than the token's own cleared (not multiplied
    by 0, so that no slot's inf or NaN reaches another's rows), times the stacked B, in place."""
    every = x @ stacks.flat[:, :width].flatten(1)  # a view: each row of A strided by the table's width
    out.addmm_(every.masked_fill_(foreign, 0), stacks.b[:width].flatten(0, 1))


def applied(rows: Rows | None) -> contextlib.AbstractContextManager:
    """`rows.applied()`, or nothing to do when there are no adapter rows."""
    return contextlib.nullcontext() if rows is None else rows.applied()


class _Plan:
    """A forward's tokens that have an adapter, sorted by slot, for one token count."""

    def __init__(self, slots: torch.Tensor, table: AdapterTable, rows: int):
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
        """For the dense products: [tokens, width * rank], True but where a token's own slot's
        columns are (slot 0, the base's, is zero anyway); those are cleared, not multiplied by 0,
        so that no slot's inf or NaN reaches another's rows."""
        dense = self.single is None and len(slots) <= DENSE_TOKENS and self.width * table.rank <= table.dense_columns
        if dense:
            mask = torch.zeros(len(slots), self.width, table.rank, dtype=torch.bool, device=table.device)
            mask[torch.arange(len(slots), device=slots.device), slots] = True
            self.foreign = ~mask.view(len(slots), -1)
        self.identity = self.foreign is not None or (adapted == len(slots) and self.single is not None)
        """Whether every token is computed in place (no gathering, no scattering): all use one
        slot, or the dense products run on every token."""
        counts = torch.bincount(slots[self.order], minlength=self.width)
        self.ends = counts.cumsum(0).to(torch.int32)
        """Per slot, where its tokens end in `order` (`torch._grouped_mm`'s offsets)."""
        self.padded: torch.Tensor | None = None
        """For the padded products (several adapters, not dense, `PADDED_WASTE`): for each slot read,
        `most` places (the most tokens any slot has), holding that slot's tokens' indices into the
        forward; the places left over hold the first adapted token's, computed and dropped (no
        slot's inf or NaN reaches another's rows)."""
        self.kept: torch.Tensor | None = None
        """Where each of `order`'s tokens sits among the padded products' places."""
        self.placed: torch.Tensor | None = None
        """When every token has an adapter: where each token, in the forward's order, sits among the
        padded products' places (the deltas then added in place, not scattered)."""
        self.gathered: torch.Tensor | None = None
        """The slots the padded products read, gathered from the stacks, when those from 1 to the
        highest used would be more than `PADDED_SPREAD` times those used; None: that range, as views."""
        self.row_slots: torch.Tensor | None = None
        """For the products by row (several adapters, every row adapted, at least `ROW_TOKENS` tokens
        a row: a prefill's forward): each row's slot, whose A and B the row's tokens take in place."""
        if (self.single is None and self.foreign is None and adapted == len(slots)
                and len(slots) >= max(ROW_TOKENS, ROW_RANKS * table.rank) * rows):
            self.row_slots = slots[::len(slots) // rows]
        elif self.single is None and self.foreign is None:
            self._pad(slots[self.order], distinct, counts, len(slots))

    def _pad(self, by_slot: torch.Tensor, distinct: torch.Tensor, counts: torch.Tensor, tokens: int) -> None:
        """Lay the adapted tokens (`by_slot`: their slots, in `order`; of `tokens`) out for the
        padded products, unless the padding would be most of the work (`PADDED_WASTE`: grouped
        products then)."""
        gather = self.width - 1 > PADDED_SPREAD * len(distinct)
        blocks, block = (len(distinct), torch.searchsorted(distinct, by_slot)) if gather else (self.width - 1, by_slot - 1)
        most, adapted = int(counts.max()), len(by_slot)
        if blocks * most > PADDED_WASTE * adapted:
            return
        self.blocks = blocks
        """How many slots the padded products read."""
        self.one_each = most == 1
        """Whether each slot read has one token (a decode step's rows over as many adapters): its
        x A then taken as A's rows against the token, `A @ x^T`, which streams each slot's A as
        it is stored ([rank, in]): 10.5 against 14.8 ms for 32 slots of rank 32 over SmolLM2's
        projections, the whole decode step's products 28.5 -> 24.4 ms (rank 8: 8.4 -> 7.8)."""
        self.gathered = distinct if gather else None
        self.kept = block * most + torch.arange(adapted, device=by_slot.device) - (self.ends - counts)[by_slot]
        self.padded = self.order[:1].repeat(blocks * most)
        self.padded[self.kept] = self.order
        if adapted == tokens:
            self.placed = torch.empty_like(self.kept)
            self.placed[self.order] = self.kept

    def _read(self, stack: torch.Tensor) -> torch.Tensor:
        """The padded products' slots of `stack` (A's or B's)."""
        return stack[1:self.width] if self.gathered is None else stack.index_select(0, self.gathered)

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        """The forward's tokens `x` [tokens, in] as the products take them: all of them (`identity`),
        padded by slot, or the adapted ones in `order`."""
        if self.row_slots is not None:
            return x.view(len(self.row_slots), -1, x.shape[1])
        if self.identity:
            return x
        if self.padded is not None:
            return x.index_select(0, self.padded).view(self.blocks, -1, x.shape[1])
        return x.index_select(0, self.order)

    def add_one(self, out: torch.Tensor, x: torch.Tensor, stacks: LowRank) -> None:
        """out [tokens, out] += (x A[slot]) B[slot] for each adapted token, `x` as `pick` gave it;
        in place where every token is computed in place (`identity`, the second product
        accumulating: `addmm_`, no delta tensor) or the padded deltas land in the forward's order,
        else scattered to the adapted tokens' rows."""
        if self.row_slots is not None:
            a = stacks.a.transpose(1, 2).index_select(0, self.row_slots).transpose(1, 2)  # gathered as stored
            b = stacks.b.index_select(0, self.row_slots)
            out.view(len(self.row_slots), -1, out.shape[1]).baddbmm_(torch.bmm(x, a), b)
        elif self.identity and self.single is not None:
            out.addmm_(x @ stacks.a[self.single], stacks.b[self.single])
        elif self.identity:
            _add_dense(out, x, stacks, self.width, self.foreign)
        elif self.padded is not None:
            if self.one_each:
                low = torch.bmm(self._read(stacks.a.transpose(1, 2)), x.transpose(1, 2)).transpose(1, 2)
            else:
                low = torch.bmm(x, self._read(stacks.a))
            deltas = torch.bmm(low, self._read(stacks.b)).flatten(0, 1)
            if self.placed is not None:
                out.add_(deltas.index_select(0, self.placed))
            else:
                out.index_add_(0, self.order, deltas.index_select(0, self.kept))
        elif self.single is not None:
            out.index_add_(0, self.order, x @ stacks.a[self.single] @ stacks.b[self.single])
        else:
            out.index_add_(0, self.order, torch._grouped_mm(torch._grouped_mm(x, stacks.a[:self.width], offs=self.ends),
                                                            stacks.b[:self.width], offs=self.ends))
