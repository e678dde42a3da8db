"""Answering a request whose prompt is built: the request's own checks (the model, or the LoRA
adapter it names or its tenant and user route to: flywheel/serve/adapter_routing.py; the context
window, the token limit), a `Generation` on the engine its session routes to, run whole under the
request timeout or streamed, both inside the concurrency limit, with engine and recording
failures mapped to API errors; and what the gateway counts and remembers when it ends.

Every answer carries `X-Interaction-Id`: the id of the turn it records (the ids of its choices,
comma-separated, with n > 1), which feedback about that turn names. A client that goes away
before a whole answer is ready (a timeout, a cancelled task) has its request aborted in the
engine and its turn recorded as `client_disconnected`, as a stream's is: an answer nobody
received is not trained with what follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from flywheel.config.schema import ServeConfig
from flywheel.formats.tool_calls import ToolFormat
from flywheel.serve.adapter_routing import AdapterRouting
from flywheel.serve.api.chat import ChatCompletionRequest, CompletionRequest
from flywheel.serve.api.errors import APIError
from flywheel.serve.api.sessions import SessionInfo
from flywheel.serve.api.sse import EventStreamResponse
from flywheel.serve.api.wire import OpenAIWire, Wire
from flywheel.serve.backends.base import EngineError
from flywheel.serve.backends.pool import EnginePool
from flywheel.serve.best_of import BestOf, best_of
from flywheel.serve.continuation import SessionContinuations
from flywheel.serve.in_flight import Generation
from flywheel.serve.ops.limits import ConcurrencyLimiter, request_timeout
from flywheel.serve.ops.metrics import ServeMetrics
from flywheel.serve.personal_data import PersonalData
from flywheel.serve.prompts import PromptBuilder
from flywheel.serve.recorder import Recorder, RecordLost
from flywheel.tenants.forgotten import Forgettings
from flywheel.tenants.sessions import SessionRegistry


@dataclass
class GatewayStats:
    requests: int = 0
    turns: int = 0
    feedback: int = 0
    started_at: float = field(default_factory=time.time)


class Answerer:
    def __init__(self, pool: EnginePool, tokenizer: Any, recorder: Recorder, model_name: str, config: ServeConfig,
                 context_length: int, metrics: ServeMetrics, continuations: SessionContinuations,
                 limiter: ConcurrencyLimiter, sessions: SessionRegistry, personal_data: PersonalData,
                 adapters: AdapterRouting | None = None, forgettings: Forgettings | None = None,
                 prompts: PromptBuilder | None = None, best_of: int = 1):
        self.pool = pool
        self.tokenizer = tokenizer
        self.recorder = recorder
        self.model_name = model_name
        self.config = config
        self.context_length = context_length
        self.metrics = metrics
        self.continuations = continuations
        self.limiter = limiter
        self.sessions = sessions
        self.personal_data = personal_data
        self.forgettings = forgettings
        """Forgets heard of: a request under way at one is not recorded."""
        self.adapters = adapters or AdapterRouting(model_name, pool)
        """Which adapter answers a request, and whether `model` may be asked for at all."""
        self.prompts = prompts
        self.best_of = best_of
        """`memory.best_of`: replies sampled for a request the served memory put instructions in
        (flywheel/serve/best_of.py; `prompts` renders the request without their words)."""
        self.stats = GatewayStats()

    def new_token_budget(self, body: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], capped: bool) -> int:
        """How many tokens the answer may have. A prompt that fills the context is a 400; a limit
        above `serve.max_new_tokens` is a 400, or with `capped` (the Responses and Messages APIs:
        agents ask for their model's maximum, Claude Code 32000) lowered to it."""
        config = self.config
        if len(prompt_ids) >= self.context_length:
            raise APIError(400, f"the prompt is {len(prompt_ids)} tokens; this model's context window is {self.context_length}",
                           "messages" if isinstance(body, ChatCompletionRequest) else "prompt", "context_length_exceeded")
        requested = body.requested_max_tokens()
        if requested is not None and requested > config.max_new_tokens:
            if not capped:
                raise APIError(400, f"max_tokens is {requested}; the limit is {config.max_new_tokens}", "max_tokens")
            requested = config.max_new_tokens
        return min(requested or config.default_max_new_tokens, config.max_new_tokens, self.context_length - len(prompt_ids))

    async def answer(self, request: Request, headers: MutableMapping[str, str],
                     body: ChatCompletionRequest | CompletionRequest, session: SessionInfo, prompt_ids: list[int],
                     prompt_text: str | None, forced: str = "", tool_format: ToolFormat | None = None,
                     wire: Wire | None = None) -> Any:
        """The answer to `request`: a whole API object (its headers go in `headers`), or an event
        stream. `wire` is the API's (OpenAI's chat or completions when None)."""
        self.stats.requests += 1
        adapter = self.adapters.choose(body.model, session.tenant, session.user_id, session.session_id)  # unknown: 404
        generation = Generation(
            body=body, engine=self.pool.route(session.session_id), tokenizer=self.tokenizer, recorder=self.recorder,
            model_name=self.model_name, session=session, prompt_ids=prompt_ids, prompt_text=prompt_text,
            wire=wire or OpenAIWire(isinstance(body, ChatCompletionRequest)),
            max_new_tokens=self.new_token_budget(body, prompt_ids, capped=wire is not None),
            forced=forced, tool_format=tool_format, on_finish=self._finished, timeout_s=self.config.request_timeout_s,
            personal_data=self.personal_data, adapter=adapter.name, lora_path=adapter.lora_path,
            forgettings=self.forgettings, best_of=await self._best_of(body, session, forced, tool_format),
        )
        if not session.anonymous and session.store:
            for choice in generation.choices:
                await self.sessions.opened(generation.session_of(choice), session.tenant)
        interaction = {"X-Interaction-Id": ",".join(choice.rid for choice in generation.choices)}
        if body.stream:
            await self.limiter.acquire(session.tenant)  # a 429 must be a real status, before the stream starts
            generation.announce()
            return EventStreamResponse(generation.events(), on_close=lambda: self.limiter.release(session.tenant),
                                       headers=interaction)
        headers.update(interaction)
        try:
            async with request_timeout(self.config.request_timeout_s), self.limiter.slot(session.tenant):
                generation.announce()
                return await _unless_client_leaves(generation, request.receive)
        except EngineError as exc:
            raise APIError(exc.status, str(exc)) from None
        except RecordLost as exc:
            raise APIError(503, f"the answer could not be recorded ({exc}); send the request again", code="not_recorded") from None

    async def _best_of(self, body: ChatCompletionRequest | CompletionRequest, session: SessionInfo, forced: str,
                       tool_format: ToolFormat | None) -> BestOf | None:
        if self.best_of < 2 or self.prompts is None:
            return None
        return await best_of(self.best_of, body, session, self.prompts, self.model_name, forced, tool_format is not None)

    def _finished(self, generation: Generation) -> None:
        """Counts, metrics, and each main choice's exact ids kept for the session's next prompt."""
        self.stats.turns += generation.body.n
        if generation.session.turn_type == "main" and not generation.session.anonymous and generation.session.store \
                and not generation.forgotten():
            for choice in generation.choices:
                self.continuations.remember(generation.session.session_id, generation.prompt_ids + choice.output_ids,
                                            generation.continued_text(choice))
        metrics = self.metrics
        if generation.best_of is not None:
            metrics.best_of(generation.chosen)
        metrics.tokens(len(generation.prompt_ids) * generation.body.n, sum(len(c.output_ids) for c in generation.choices))
        for choice in generation.choices:
            if choice.first_token_at is None:
                continue
            metrics.time_to_first_token(choice.first_token_at - generation.arrived)
            if len(choice.output_ids) > 1 and choice.last_token_at:
                metrics.time_per_output_token((choice.last_token_at - choice.first_token_at) / (len(choice.output_ids) - 1))


async def _unless_client_leaves(generation: Generation, receive: Receive) -> Any:
    """The whole answer, unless the client disconnects first: then the generation is cancelled
    (its engine requests aborted) with its choices marked as the client's doing. A cancellation
    of this task (the request timeout) reaches the generation too."""
    answer = asyncio.ensure_future(generation.complete())
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await answer  # recorded, as aborted
        raise
    finally:
        gone.cancel()
    if not answer.done():
        generation.client_left()
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await answer
        return Response(status_code=499)  # nobody reads it
    return answer.result()


async def _disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request's body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
