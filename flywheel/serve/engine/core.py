"""The embedded engine: continuous batching over a KV cache, with exact token ids, behaviour
logprobs and the weight version of every sampled token.

A worker thread owns the model. Between two decode steps it runs control commands (pause, continue,
abort, weight updates), admits waiting requests (`admission.Admission`: prefilled together, then
merged into the running batch, see `kv_cache.KVBatch`), and removes finished ones; each decode step
advances every running request by one token (Llama-family models through the engine's own
forward, `decoder.Decoder`, with fused and packed weights, on CUDA replayed from graphs,
`decode_graphs`; others through transformers'). A round prefills at most
`chunked_prefill_size` prompt tokens, shortest prompt first (`schedule_policy`), a longer prompt in
pieces over several rounds (`chunked`). While prompts wait, rounds run back to back until the
running streams' last tokens are `max_stall_s` old; then a decode step gives each a token. A
weight update is applied between steps (the decoder's weights rebuilt after it): generations in
flight go on, and each token records the version that sampled it. Pausing follows SGLang's modes:
`abort` ends every request with its partial output, `retract` sends running requests back to the
queue (their KV cache is recomputed, under the weights current when they resume), `in_place` just
stops stepping and keeps the cache.

The version is an opaque string label, as in SGLang ("0" unless given; a weight update sets the
label it names).

LoRA adapters (`adapters.Adapters`): a request may name one (SGLang's `lora_path`); rows of many
adapters and of the bare base decode in the same batch, each row's low-rank product beside the
shared base product (`flywheel.models.lora_batch`), and a step with no adapter row does no LoRA
work at all. A request holds its adapter's slot from its admission until it leaves; one whose
adapter finds no slot (every slot held by requests in the engine) waits in the queue, and a
round that can admit nobody for that reason ends with a decode step. Loading a new version of an
adapter (`load_adapter`) replaces it between two steps, as a weight update does. Each token
records what sampled it: a row without an adapter the engine's label, a row with one its
adapter's `<name>@<label>` (`alice@3`: the load's label, else the count of that name's versions).

A failure that belongs to one request (its prefill raises, its distribution is not
finite, its bans or finish checks raise, its result cannot be built) fails that request alone: it
leaves the batch, its caller gets a `RequestFailed`, and the others go on (newcomers whose joint
prefill failed are prefilled again one by one, to find the one to blame). Only a failed decode
step, which no request can be blamed for, fails every running request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from flywheel.formats.grammar import end_ids
from flywheel.serve.engine.adapter_commands import AdapterCommands
from flywheel.serve.engine.adapters import Adapters
from flywheel.serve.engine.admission import Admission
from flywheel.serve.engine.chunked import SchedulePolicy
from flywheel.serve.engine.decode_graphs import DecodeGraphs
from flywheel.serve.engine.decoder import Decoder
from flywheel.serve.engine.grammar import Grammars
from flywheel.serve.engine.kv_cache import KVBatch
from flywheel.serve.engine.request import (
    GenerationResult,
    Request,
    RequestFailed,
    TokenDelta,
    drain,
    resolve,
)
from flywheel.serve.engine.sampling import SamplingParams
from flywheel.serve.engine.stepping import post, sample_rows

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]


@dataclass
class _Command:
    name: str
    args: dict[str, Any]
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future | None


class Engine(Admission, AdapterCommands):
    """Generation over one model; safe to call from any asyncio event loop."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        version: str = "0",
        max_batch_size: int = 32,
        context_length: int | None = None,
        load_weights: Callable[[torch.nn.Module, str], None] | None = None,
        chunked_prefill_size: int = 512,
        schedule_policy: SchedulePolicy = "shortest-first",
        max_stall_s: float = 0.5,
        own_decoder: bool = True,
        max_loras: int = 8,
        lora_root: str | None = None,
        cuda_graphs: bool = True,
    ):
        self.model = model.eval()
        self.chunked_prefill_size = chunked_prefill_size
        self.schedule_policy = schedule_policy
        self.max_stall_s = max_stall_s
        self._tokens_at = 0.0  # when the running rows' oldest last token was sampled
        self.tokenizer = tokenizer
        self.version = version
        self.max_batch_size = max_batch_size
        self.context_length = context_length or getattr(model.config, "max_position_embeddings", 2048)
        self._load_weights = load_weights
        self.eos_ids = end_ids(model.generation_config, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.vocab_size = len(tokenizer)
        self.grammars = Grammars(tokenizer, model.config.vocab_size, self.eos_ids)
        self.paused = False
        self._waiting: deque[Request] = deque()
        self._commands: deque[_Command] = deque()
        self._rows: list[Request] = []
        """The running requests; row i of the batch is `_rows[i]`."""
        self._batch = KVBatch(model, max_batch_size)
        self.adapters = Adapters(model, max_loras, lora_root)
        self._admission_blocked = False
        """Whether the last round could admit no waiting request: each waits for an adapter slot."""
        self._own_decoder = own_decoder
        self._decoder: Decoder | None = None  # built on the worker thread; None: transformers' forward
        self._cuda_graphs = cuda_graphs
        self._graphs: DecodeGraphs | None = None  # on CUDA, with the decoder: its steps captured
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self.stats = dict.fromkeys(("requests", "tokens", "steps", "prefills", "weight_updates", "aborted", "failed"), 0)

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

    # ---- generation ------------------------------------------------------------------------

    def _submit(self, input_ids: list[int], params: SamplingParams, rid: str | None, stream: bool,
                adapter: str | None) -> Request:
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        if len(input_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(input_ids)} tokens; the context window is {self.context_length}")
        if adapter is not None:
            self.adapters.require(adapter)  # UnknownAdapter, a ValueError
        loop = asyncio.get_running_loop()
        request = Request(
            rid or uuid.uuid4().hex, list(input_ids), params, loop, loop.create_future(),
            asyncio.Queue() if stream else None, self.eos_ids, self.context_length, self.tokenizer,
            matcher=self.grammars.matcher(params), adapter=adapter,
        )
        with self._wake:
            if not self._running:
                raise RuntimeError("engine is not running")
            self._waiting.append(request)
            self._wake.notify()
        return request

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                       adapter: str | None = None) -> GenerationResult:
        """Generate after `input_ids`, with the LoRA adapter named `adapter` (None: the base)."""
        request = self._submit(input_ids, params, rid, stream=False, adapter=adapter)
        try:
            return await asyncio.shield(request.future)
        except asyncio.CancelledError:
            self.abort_nowait(request.rid)
            raise

    async def stream(
        self, input_ids: list[int], params: SamplingParams, rid: str | None = None, adapter: str | None = None
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """Token deltas as they are sampled, then the final `GenerationResult`. A consumer that
        falls behind gets the tokens that piled up as one delta (fewer, larger chunks, never
        fewer tokens). A consumer that stops iterating early aborts the request."""
        request = self._submit(input_ids, params, rid, stream=True, adapter=adapter)
        try:
            async for item in drain(request.queue):
                yield item
        finally:
            if not request.future.done():
                self.abort_nowait(request.rid)

    # ---- control ---------------------------------------------------------------------------

    async def _command(self, name: str, **args: Any) -> Any:
        loop = asyncio.get_running_loop()
        command = _Command(name, args, loop, loop.create_future())
        with self._wake:
            self._commands.append(command)
            self._wake.notify()
        return await command.future

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._command("pause", mode=mode)

    async def resume(self) -> None:
        await self._command("resume")

    async def update_weights(self, path: str, version: str, abort_all: bool = False) -> float:
        """Load weights from `path` at the next step boundary; later tokens carry the label `version`.
        Returns the seconds generation stood still for the load."""
        if self._load_weights is None:
            raise RuntimeError("this engine was built without a weight loader")
        return await self._command("update", path=path, version=version, abort_all=abort_all)

    async def abort(self, rid: str | None = None) -> int:
        """Abort one request (or all, when `rid` is None); returns how many were aborted."""
        return await self._command("abort", rid=rid)

    def abort_nowait(self, rid: str) -> None:
        with self._wake:
            self._commands.append(_Command("abort", {"rid": rid}, None, None))
            self._wake.notify()

    def load(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self._rows),
            "num_waiting_reqs": len(self._waiting),
            "paused": self.paused,
            "cached_tokens": self._batch.cached_tokens,
            "cache_slots": self._batch.capacity_tokens,
            "weight_version": self.version,
            "resident_adapters": self.adapters.resident(),
        }

    # ---- worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        with torch.inference_mode():
            if self._own_decoder:  # packed here: torch work on another thread slows this one (docs/experiments/odd-things.md)
                self._decoder = Decoder.build(self.model, self.max_batch_size)
            if self._decoder is not None and self._cuda_graphs and self._batch.device.type == "cuda":
                self._graphs = DecodeGraphs.build(self._decoder, self._batch, self.adapters.table)
            self._serve_forever()

    def _serve_forever(self) -> None:
        while True:
            with self._wake:
                while self._running and not self._commands and (self.paused or not (self._rows or self._waiting)):
                    self._wake.wait()
                if not self._running:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                self._execute(command)
            if self.paused:
                continue
            try:
                self._admit()
                if self._decode_due():
                    self._decode()
            except Exception as exc:  # a bug or OOM fails the running requests, not the engine
                log.exception("engine step failed")
                self._fail_all(exc)
        self._fail_all(RuntimeError("engine stopped"))

    def _execute(self, command: _Command) -> None:
        try:
            result = getattr(self, f"_do_{command.name}")(**command.args)
        except Exception as exc:
            log.exception("engine command %s failed", command.name)
            if command.future is not None:
                resolve(command.loop, command.future, error=exc)
            return
        if command.future is not None:
            resolve(command.loop, command.future, result)

    def _do_pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self._do_abort(None)
        elif mode == "retract":
            with self._wake:
                self._waiting.extendleft(reversed(self._rows))
            self._rows = []
            self._batch.clear()
            for request in self._waiting:  # recomputed under the weights current when they resume
                request.partial = None
        self.paused = True

    def _do_resume(self) -> None:
        self.paused = False

    def _do_update(self, path: str, version: str, abort_all: bool) -> float:
        if abort_all:
            self._do_abort(None)
        started = time.monotonic()
        self._load_weights(self.model, path)
        if self._decoder is not None:
            self._decoder.refresh()
        self.version = version
        self.stats["weight_updates"] += 1
        seconds = time.monotonic() - started
        log.info("weights %r loaded in %.3fs", version, seconds)
        return seconds

    def _do_abort(self, rid: str | None) -> int:
        with self._wake:
            waiting = [r for r in self._waiting if rid is None or r.rid == rid]
            for request in waiting:
                self._waiting.remove(request)
        running = [r for r in self._rows if rid is None or r.rid == rid]
        for request in waiting:
            request.finish = {"type": "abort", "message": "Abort in waiting queue"}
        for request in running:
            request.finish = {"type": "abort", "message": "Abort requested"}
        self._drop_finished()
        for request in waiting:
            self._complete(request)
        self.stats["aborted"] += len(waiting) + len(running)
        return len(waiting) + len(running)

    def _fail_all(self, error: Exception) -> None:
        with self._wake:
            doomed = list(self._waiting) + self._rows
            self._waiting.clear()
        self._rows = []
        self._batch.clear()
        for request in doomed:
            self._fail(request, error)

    def _fail(self, request: Request, error: Exception) -> None:
        self.stats["failed"] += 1
        self._leave(request)
        request.fail(error)

    def _decode(self) -> None:
        if not self._rows:
            return
        tokens = torch.tensor([r.output_ids[-1] for r in self._rows])
        logits = self._batch.step(self.model, tokens, self._decoder, self._lora(self._rows), self._graphs)
        self._tokens_at = time.monotonic()
        self.stats["steps"] += 1
        self._sample(self._rows, logits)
        self._drop_finished()

    def _sample(self, rows: list[Request], logits: torch.Tensor) -> None:
        versions = [r.lora.version if r.lora is not None else self.version for r in rows]
        recorded, deltas = sample_rows(rows, logits, versions)
        self.stats["tokens"] += recorded  # counted before the callers can see the tokens
        post(deltas)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if not r.done]
        if len(keep) == len(self._rows):
            return
        finished = [r for r in self._rows if r.done]
        order = self._batch.retain(keep)
        self._rows = [self._rows[i] for i in order]
        for request in finished:
            if request.error is not None:
                self._fail(request, request.error)
            else:
                self._complete(request)

    def _complete(self, request: Request) -> None:
        self._leave(request)
        try:
            result = request.result()
        except Exception as exc:
            log.exception("request %s: could not build its result", request.rid)
            self._fail(request, RequestFailed(f"request {request.rid} failed: could not build its result: {exc}"))
            return
        self.stats["requests"] += 1  # counted before the caller can see the result
        request.deliver(result)
