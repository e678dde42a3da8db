"""The embedded engine: batched generation with a KV cache, exact token ids, behaviour logprobs
and the weight version of every sampled token.

A worker thread owns the model. It takes up to `max_batch_size` waiting requests, decodes them
together (left-padded, one shared `DynamicCache`) until every row has finished, and resolves
each request's future on its event loop. Weight updates are queued and applied by the same
thread between batches, so a generation never sees weights change under it and the version
recorded for each token is the one that sampled it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from serve.engine.sampling import SamplingParams, sample

log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """What the engine returns for one request (the native `/generate` response carries it)."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finish_reason: dict[str, Any]
    """SGLang's shape: {"type": "stop", "matched": id|str} or {"type": "length", "length": n}."""
    queued_s: float
    first_token_s: float
    total_s: float


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class _Row:
    """Decoding state of one request inside a running batch."""

    request: _Request
    generator: torch.Generator | None
    stop_ids: set[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish: dict[str, Any] | None = None
    started: float = 0.0
    first_token: float = 0.0


class Engine:
    """Generation over one model; thread-safe to call from any asyncio loop."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        version: int = 0,
        max_batch_size: int = 32,
        context_length: int | None = None,
        load_weights: Callable[[torch.nn.Module, str], None] | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = version
        self.max_batch_size = max_batch_size
        self.context_length = context_length or getattr(model.config, "max_position_embeddings", 2048)
        self._load_weights = load_weights
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self._waiting: deque[_Request] = deque()
        self._updates: deque[tuple[str, int, asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self.stats = {"requests": 0, "tokens": 0, "batches": 0, "weight_updates": 0}

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> "Engine":
        self._running = True
        self._thread = threading.Thread(target=self._work, name="engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- API -------------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], params: SamplingParams, rid: str | None = None
    ) -> GenerationResult:
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        if len(input_ids) >= self.context_length:
            raise ValueError(
                f"prompt has {len(input_ids)} tokens; the context window is {self.context_length}"
            )
        loop = asyncio.get_running_loop()
        request = _Request(rid or uuid.uuid4().hex, list(input_ids), params, loop, loop.create_future())
        with self._wake:
            if not self._running:
                raise RuntimeError("engine is not running")
            self._waiting.append(request)
            self._wake.notify()
        return await request.future

    async def update_weights(self, path: str, version: int) -> None:
        """Load weights from `path` between batches and label later tokens with `version`."""
        if self._load_weights is None:
            raise RuntimeError("this engine was built without a weight loader")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._wake:
            self._updates.append((path, version, loop, future))
            self._wake.notify()
        await future

    # ---- worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._wake:
                while self._running and not self._waiting and not self._updates:
                    self._wake.wait()
                if not self._running:
                    break
                updates = list(self._updates)
                self._updates.clear()
                batch = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.max_batch_size))]
            for path, version, loop, future in updates:
                self._apply_update(path, version, loop, future)
            if batch:
                try:
                    self._run_batch(batch)
                except Exception as exc:  # a bug or OOM fails these requests, not the engine
                    log.exception("batch failed")
                    for request in batch:
                        _resolve(request.loop, request.future, error=exc)
        for request in self._waiting:
            _resolve(request.loop, request.future, error=RuntimeError("engine stopped"))

    def _apply_update(self, path: str, version: int, loop, future) -> None:
        started = time.monotonic()
        try:
            self._load_weights(self.model, path)
            self.version = version
            self.stats["weight_updates"] += 1
            log.info("weights v%d loaded in %.3fs", version, time.monotonic() - started)
            _resolve(loop, future, None)
        except Exception as exc:
            log.exception("weight update to v%d from %s failed", version, path)
            _resolve(loop, future, error=exc)

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Request]) -> None:
        now = time.monotonic()
        rows = [self._new_row(request, now) for request in batch]
        for row in rows:
            if row.request.params.max_new_tokens == 0:
                row.finish = {"type": "length", "length": 0}
        live = [row for row in rows if row.finish is None]
        if live:
            self._decode(live)
        self.stats["batches"] += 1
        for row in rows:
            self._finish(row)

    def _new_row(self, request: _Request, now: float) -> _Row:
        params = request.params
        generator = None
        if params.sampling_seed is not None:
            generator = torch.Generator().manual_seed(params.sampling_seed)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        return _Row(request, generator, stop_ids, started=now)

    def _decode(self, rows: list[_Row]) -> None:
        lengths = [len(row.request.input_ids) for row in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - lengths[i]:] = torch.tensor(row.request.input_ids)
            attention[i, width - lengths[i]:] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(input_ids, attention, positions, cache)
        params = [row.request.params for row in rows]
        generators = [row.generator for row in rows]
        while True:
            self._suppress_early_stops(logits, rows)
            tokens, logprobs = sample(logits, params, generators)
            now = time.monotonic()
            for i, row in enumerate(rows):
                if row.finish is None:
                    self._append(row, int(tokens[i]), float(logprobs[i]), now)
            if all(row.finish is not None for row in rows):
                return
            feed = torch.tensor([self.pad_id if row.finish else row.output_ids[-1] for row in rows])
            attention = torch.cat([attention, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            logits = self._forward(feed.unsqueeze(1), attention, positions, cache)

    def _forward(self, input_ids, attention, positions, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _suppress_early_stops(self, logits: torch.Tensor, rows: list[_Row]) -> None:
        for i, row in enumerate(rows):
            if row.finish is None and len(row.output_ids) < row.request.params.min_new_tokens and row.stop_ids:
                logits[i, list(row.stop_ids)] = float("-inf")

    def _append(self, row: _Row, token: int, logprob: float, now: float) -> None:
        params = row.request.params
        if not row.output_ids:
            row.first_token = now
        row.output_ids.append(token)
        row.logprobs.append(logprob)
        row.versions.append(self.version)
        if token in row.stop_ids:
            row.finish = {"type": "stop", "matched": token}
            return
        if params.stop:
            text = self.tokenizer.decode(row.output_ids, skip_special_tokens=params.skip_special_tokens)
            hits = [(text.find(s), s) for s in params.stop if s and s in text]
            if hits:
                at, matched = min(hits)
                row.text = text if params.no_stop_trim else text[:at]
                row.finish = {"type": "stop", "matched": matched}
                return
        total = len(row.request.input_ids) + len(row.output_ids)
        if len(row.output_ids) >= params.max_new_tokens or total >= self.context_length:
            row.finish = {"type": "length", "length": len(row.output_ids)}

    def _finish(self, row: _Row) -> None:
        request = row.request
        params = request.params
        if not (row.finish["type"] == "stop" and isinstance(row.finish["matched"], str)):
            row.text = self.tokenizer.decode(row.output_ids, skip_special_tokens=params.skip_special_tokens)
        end = time.monotonic()
        self.stats["requests"] += 1
        self.stats["tokens"] += len(row.output_ids)
        result = GenerationResult(
            rid=request.rid,
            prompt_ids=request.input_ids,
            output_ids=row.output_ids,
            logprobs=row.logprobs,
            versions=row.versions,
            text=row.text,
            finish_reason=row.finish,
            queued_s=row.started - request.arrived,
            first_token_s=(row.first_token or end) - request.arrived,
            total_s=end - request.arrived,
        )
        _resolve(request.loop, request.future, result)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result=None, error=None) -> None:
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop has closed; nobody is waiting any more
        pass
