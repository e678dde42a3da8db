"""One generation request inside the engine: its output so far, when it finishes, and how its
caller hears about it (a future for the final result, a queue of deltas when streaming).

Finish rules, checked after every sampled token: a stop token id (or EOS unless `ignore_eos`)
finishes with `{"type": "stop", "matched": id}` and the token is kept in the output; a stop
string finishes with `{"type": "stop", "matched": str}` and the text is cut before it (unless
`no_stop_trim`); `max_new_tokens` or the context window finishes with `{"type": "length"}`.
Until `min_new_tokens` are out, stop tokens cannot be sampled.

A request can also fail on its own (`RequestFailed`: its distribution was not finite, or its bans
or finish checks raised); it leaves the batch and its caller gets the error, the rest go on.
Each token records the label of the weights that sampled it (the engine's opaque version
string, as SGLang has it, or its adapter's `<name>@<label>`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from flywheel.serve.engine.detokenizer import IncrementalText
from flywheel.serve.engine.sampling import SEED_RANGE, SamplingParams


class RequestFailed(RuntimeError):
    """One request failed inside the engine; the requests batched with it went on."""


@dataclass
class TokenDelta:
    """Tokens sampled for one request in one step (streamed to its caller)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[str]
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def extend(self, later: "TokenDelta") -> "TokenDelta":
        """This delta followed by a later one, as one."""
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.versions += later.versions
        if self.top_logprobs is not None:
            self.top_logprobs += later.top_logprobs or []
        return self


@dataclass
class GenerationResult:
    """The finished request (the native `/generate` response carries it)."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[str]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: dict[str, Any]
    """SGLang's shape: {"type": "stop", "matched": id|str}, {"type": "length", "length": n},
    or {"type": "abort", "message": ...}."""
    queued_s: float
    first_token_s: float
    total_s: float
    input_logprobs: list[float | None] | None = None
    """SGLang's `input_token_logprobs` values from `logprob_start_len` on, when asked for."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """Its `input_top_logprobs` as (id, logprob) pairs, aligned with `input_logprobs`, when
    `top_logprobs_num` asked for them too."""


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    queue: asyncio.Queue | None
    eos_ids: set[int]
    context_length: int
    tokenizer: Any
    arrived: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish: dict[str, Any] | None = None
    error: RequestFailed | None = None
    """Set when this request failed; it then leaves the batch like a finished one."""
    overtaken: int = 0
    """Rounds in which later requests were admitted while this one waited (`chunked.plan`)."""
    text: str | None = None
    started: float = 0.0
    first_token: float = 0.0
    matcher: Any = None
    """The grammar matcher of a constrained request (`flywheel.serve.engine.grammar`), else None."""
    input_logprobs: list[float | None] | None = None
    """Filled at admission when the request asks for input log-probabilities."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    partial: Any = None
    """Its `chunked.PartialPrefill` while its prompt is prefilled in pieces."""
    adapter: str | None = None
    """The name of the LoRA adapter it is generated with; None: the base."""
    lora: Any = None
    """Its adapter's slot (`adapters.Resident`) while it holds one: from its admission until it
    leaves the engine."""

    def __post_init__(self) -> None:
        params = self.params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        seed = params.sampling_seed
        self.generator = torch.Generator().manual_seed(seed % SEED_RANGE) if seed is not None else None
        if params.top_logprobs_num:
            self.top_logprobs = []
        if params.max_new_tokens == 0:
            self.finish = {"type": "length", "length": 0}
        self._detokenizer = IncrementalText(self.tokenizer, params.skip_special_tokens) if params.stop else None
        self._stop_window = max((len(s) for s in params.stop), default=0) - 1
        self._tail = ""
        """The end of the output's text, as long as the longest stop string less one character."""

    @property
    def tokens(self) -> list[int]:
        """What its prefill runs: the prompt, and the output so far (a retracted request's)."""
        return self.input_ids + self.output_ids

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None

    def mark_failed(self, reason: str) -> None:
        """Mark this request as failed (the engine drops it and tells its caller)."""
        self.error = self.error or RequestFailed(f"request {self.rid} failed: {reason}")

    def banned_now(self) -> list[int]:
        """Token ids that may not be sampled yet (stop tokens before `min_new_tokens`)."""
        return list(self.stop_ids) if len(self.output_ids) < self.params.min_new_tokens else []

    def append(self, token: int, logprob: float, version: str, top: list[tuple[int, float]] | None, now: float) -> TokenDelta:
        if not self.output_ids:
            self.first_token = now
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.top_logprobs is not None:
            self.top_logprobs.append(top or [])
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise RuntimeError(f"its grammar rejected token {token}: {self.matcher.get_error()}")
        self.finish = self._finish_after(token)
        return TokenDelta([token], [logprob], [version], [top or []] if self.top_logprobs is not None else None)

    def _finish_after(self, token: int) -> dict[str, Any] | None:
        params = self.params
        if token in self.stop_ids:
            return {"type": "stop", "matched": token}
        if params.stop and self._stop_hit():
            text = self.tokenizer.decode(self.output_ids, skip_special_tokens=params.skip_special_tokens)
            hits = [(text.find(s), s) for s in params.stop if s in text]
            if hits:
                at, matched = min(hits)
                self.text = text if params.no_stop_trim else text[:at]
                return {"type": "stop", "matched": matched}
        if len(self.output_ids) >= params.max_new_tokens or len(self.input_ids) + len(self.output_ids) >= self.context_length:
            return {"type": "length", "length": len(self.output_ids)}
        return None

    def _stop_hit(self) -> bool:
        """Whether the text the newest token added completes a stop string: only the added text
        and the few characters before it are searched (a hit is then placed in the whole text)."""
        window = self._tail + self._detokenizer.added(self.output_ids)
        self._tail = window[-self._stop_window:] if self._stop_window > 0 else ""
        return any(s in window for s in self.params.stop)

    def result(self) -> GenerationResult:
        """The finished request's result."""
        if self.text is None:
            self.text = self.tokenizer.decode(self.output_ids, skip_special_tokens=self.params.skip_special_tokens)
        end = time.monotonic()
        started = self.started or end
        result = GenerationResult(
            rid=self.rid,
            prompt_ids=self.input_ids,
            output_ids=self.output_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            top_logprobs=self.top_logprobs,
            text=self.text,
            finish_reason=self.finish,
            queued_s=started - self.arrived,
            first_token_s=(self.first_token or end) - self.arrived,
            total_s=end - self.arrived,
            input_logprobs=self.input_logprobs,
            input_top_logprobs=self.input_top_logprobs,
        )
        return result

    def deliver(self, result: GenerationResult) -> None:
        """Hand `result` to the caller (future, and the stream if any)."""
        resolve(self.loop, self.future, result, queue=self.queue)

    def fail(self, error: Exception) -> None:
        resolve(self.loop, self.future, error=error, queue=self.queue)


def resolve(loop, future: asyncio.Future, result=None, error: Exception | None = None, queue: asyncio.Queue | None = None) -> None:
    """Settle `future` (and end `queue`) from any thread, on the owner's event loop."""

    def settle() -> None:
        if queue is not None:  # a stream's consumer reads the outcome from its queue
            queue.put_nowait(result if error is None else StreamError(error))
        if future.done():
            return
        if error is not None and queue is None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop has closed; nobody is waiting any more
        pass


def post_deltas(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, TokenDelta]]) -> None:
    """Put one step's deltas on their streams' queues, from any thread, on the owners' loop."""

    def put_all() -> None:
        for queue, delta in items:
            queue.put_nowait(delta)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the consumer's loop has closed
        pass


async def drain(queue: asyncio.Queue) -> AsyncIterator[TokenDelta | GenerationResult]:
    """A stream's items from its queue until the final `GenerationResult` (a `StreamError` is
    raised): the deltas that piled up while the consumer was away come as one."""
    held = None  # what ended a run of deltas, delivered next
    while True:
        item, held = held or await queue.get(), None
        while isinstance(item, TokenDelta) and not queue.empty():
            later = queue.get_nowait()
            if not isinstance(later, TokenDelta):
                held = later
                break
            item = item.extend(later)
        if isinstance(item, StreamError):
            raise item.error
        yield item
        if isinstance(item, GenerationResult):
            return


@dataclass
class StreamError:
    """Put on a stream's queue when its request failed."""

    error: Exception
