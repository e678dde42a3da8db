"""Decode steps replayed from CUDA graphs: the embedded engine's own decode step (`decoder.Decoder`)
captured once per batch bucket (with adapter rows or without) and replayed, one launch for the
~1,340 kernels of a step.

On a GPU a decode step of a small model is bound by launching its kernels, not by running them
(SmolLM2-135M on an H200: the GPU idle 67-88 % of an eager step, docs/experiments/gpu-path.md), and
adapters' products add ~47 % more launches (630 beside ~1,340; docs/experiments/adapters.md). A
CUDA graph records a step's kernels with their arguments and launches them all at once. What it
records is fixed, so the step it captures has fixed shapes and reads its inputs from fixed tensors:

- the rows are padded up to a bucket (`BUCKETS`, at most the batch's slots): a padded row feeds
  whatever token its place last held at column 0 of a slot no live row holds (the live rows are
  slots 0..n-1, and a slot's next occupant writes its own prompt over column 0), and its logits
  are dropped;
- each row attends over all of the cache's allocated columns, those beyond its own length masked
  (an eager step attends up to the longest row: a little more arithmetic, no more launches);
- rows with adapters take `lora_batch.FixedRows`: the dense products over every slot, each row's
  slot a tensor the graph reads, so that which adapters a step uses changes no shape. A table
  whose slot columns exceed the dense products' limit (`AdapterTable.fixed_fits`) steps eagerly;
- tokens, positions and slots are copied into the graph's own input tensors before each replay,
  and its logits copied out after (a later capture may reuse an earlier graph's scratch memory).

A graph is captured on first use of its (bucket, adapters or not), after one eager warm-up of
the same step (which writes the same keys and values the replay writes again), on the engine's
own stream, one capture at a time in a process. A graph replays on the addresses it captured:
the decoder's fused weights, the cache's tensors, the adapter table's stacks (the model's own
parameters are updated in place). When any of those is allocated anew (a weight update's
`Decoder.refresh`, the cache growing or given back, a new adapted layer or a higher rank: their
`generation`s, bumped before they change, and every cache tensor's address), every graph is
dropped and captured again on next use. Writing an adapter into a slot writes in place: the
graphs read the new matrices. Rotary embeddings that recompute their frequencies as sequences
grow are not captured (`DecodeGraphs.build`); a capture that fails anyway is logged and the
engine steps eagerly from then on. Off CUDA the same padded step runs eagerly, uncaptured (how
the tests check it on a CPU).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flywheel.models.lora_batch import AdapterTable, Rows
from flywheel.serve.engine.decoder import Decoder

if TYPE_CHECKING:
    from flywheel.serve.engine.kv_cache import KVBatch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Batch widths a graph is captured for; a step of n rows replays the smallest that holds n (or
the batch's slots, when fewer)."""


@dataclass
class _Graph:
    """One captured step: its input tensors, its logits, and the graph (None off CUDA)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor | None
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """The decode steps of one engine's batch, captured per batch width (see module docstring)."""

    def __init__(self, decoder: Decoder, batch: KVBatch, table: AdapterTable):
        self.decoder = decoder
        self.batch = batch
        self.table = table
        self.capture = batch.device.type == "cuda"
        self.failed: str | None = None
        """Why a capture failed, if one did: the engine then steps eagerly."""
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._held: tuple | None = None
        """What the graphs captured: the decoder's and table's generations, the cache's width and addresses."""
        self._pool = None
        self._stream = torch.cuda.Stream(batch.device) if self.capture else None
        """This engine's own capture stream (two engines in a process must not capture on one)."""
        self.captures = 0
        """Graphs captured so far (the tests count them)."""

    @classmethod
    def build(cls, decoder: Decoder, batch: KVBatch, table: AdapterTable) -> DecodeGraphs | None:
        """`DecodeGraphs` for this decoder, or None where its steps cannot be captured: a rotary
        embedding that recomputes its frequencies as sequences grow (dynamic and long ropes read
        the position back to the host, which a capture may not do)."""
        rope = getattr(decoder.model.model.rotary_emb, "rope_type", "default")
        if "dynamic" in rope or rope == "longrope":
            log.info("engine: decode steps not captured as CUDA graphs (rope type %r)", rope)
            return None
        return cls(decoder, batch, table)

    def serves(self, lora: Rows | None) -> bool:
        """Whether a step of these rows can be replayed (else the engine steps eagerly)."""
        return self.failed is None and (lora is None or self.table.fixed_fits)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, lora: Rows | None) -> torch.Tensor:
        """One token per row, as `Decoder.step` over the whole batch: `tokens` [rows] at
        `positions` [rows]; each row with the adapter of its row in `lora`, if any. Returns
        next-token logits [rows, vocab] in float32."""
        rows = len(tokens)
        self._drop_stale()
        bucket = min(next((b for b in BUCKETS if b >= rows), self.batch.max_rows), self.batch.max_rows)
        key = (bucket, lora is not None)
        graph = self._graphs.get(key)
        fresh = graph is None
        if fresh:
            graph = self._inputs(bucket, lora is not None)
        graph.tokens[:rows].copy_(tokens)
        graph.positions[:rows].copy_(positions)
        graph.positions[rows:].zero_()
        if graph.slots is not None:
            graph.slots[:rows].copy_(torch.tensor(lora.slots))
        if not self.capture:
            return self._run(graph)[:rows]
        with torch.cuda.device(self.batch.device):
            if fresh:
                try:
                    self._capture(graph)
                except Exception as exc:  # the engine steps eagerly from now on; this step too
                    self.failed = f"{type(exc).__name__}: {exc}"
                    log.exception("engine: capturing a decode step failed; decode steps are eager from now on")
                    return self._run(graph)[:rows]
                self._graphs[key] = graph
            graph.graph.replay()
            return graph.logits[:rows].clone()

    def _drop_stale(self) -> None:
        held = (self.decoder.generation, self.table.generation, self.batch.columns,
                *(store.data_ptr() for store in self.batch.keys + self.batch.values))
        if held != self._held:
            self._graphs.clear()
            self._pool = torch.cuda.graph_pool_handle() if self.capture else None
            self._held = held

    def _inputs(self, bucket: int, adapted: bool) -> _Graph:
        device = self.batch.device
        zeros = torch.zeros(bucket, dtype=torch.long, device=device)
        return _Graph(tokens=zeros, positions=zeros.clone(), slots=zeros.clone() if adapted else None)

    def _run(self, graph: _Graph) -> torch.Tensor:
        """The step over the graph's inputs: every row of its bucket, every allocated column."""
        batch = self.batch
        columns = torch.arange(batch.columns, device=batch.device)
        visible = columns[None, :] <= graph.positions[:, None]
        lora = self.table.fixed_rows(graph.slots) if graph.slots is not None else None
        return self.decoder.step(graph.tokens, graph.positions, batch.keys, batch.values,
                                 [(0, len(graph.tokens), visible)], lora)

    def _capture(self, graph: _Graph) -> None:
        """On this engine's capture stream: the step run once (the warm-up CUDA graphs require; it
        writes the keys and values the replay writes again), then captured. One capture at a time
        in a process (`_CAPTURING`); the stream is left whether the capture ends or raises."""
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with _CAPTURING, torch.cuda.stream(stream):
            self._run(graph)
            captured = torch.cuda.CUDAGraph()
            captured.capture_begin(pool=self._pool, capture_error_mode="thread_local")  # others' threads may run
            try:
                logits = self._run(graph)
            finally:
                captured.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        graph.graph, graph.logits = captured, logits
        self.captures += 1


_CAPTURING = threading.Lock()
"""Held while a graph is captured: two engines of one process never capture at once."""
