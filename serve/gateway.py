"""The HTTP gateway: OpenAI's chat and text completions and Responses, Anthropic's Messages,
models, session signals.

The gateway renders chat templates and tokenizes once; those prompt ids, and the output ids,
logprobs and weight versions the engine returns, are what each recorded `Turn` carries. It
reaches engines only through SGLang's native protocol (`EnginePool` / `EngineClient`).
Feedback and explicit session ends become `SessionEvent`s. Recording goes through the
`Recorder`, off the response path.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from bus import SESSION_EVENT_SUBJECT, SessionEvent
from config.schema import ServeConfig
from serve.auth import install_auth
from serve.continuation import SessionContinuations
from serve.engine_client import EngineError
from serve.engine_pool import EnginePool
from serve.errors import APIError, install_error_handlers, validation_message
from serve.generation import Generation
from serve.limits import ConcurrencyLimiter, install_body_limit, request_timeout
from serve.metrics import ServeMetrics, install_metrics_route, install_request_metrics
from serve.messages import CountTokensRequest, MessagesRequest
from serve.messages_wire import MessagesWire
from serve.recorder import RecordLost, Recorder
from serve.responses import ResponsesRequest
from serve.responses_wire import ResponsesWire, ResponseStore
from serve.schema import ChatCompletionRequest, CompletionRequest
from serve.sessions import FeedbackRequest, SessionInfo, session_of
from serve.sse import EventStreamResponse
from serve.tool_formats import FORMATS, HERMES, ToolFormat, detect
from serve.tools import adapt_messages, template_support
from serve.wire import OpenAIWire, Wire


@dataclass
class GatewayStats:
    requests: int = 0
    turns: int = 0
    feedback: int = 0
    started_at: float = field(default_factory=time.time)


class PromptBuilder:
    """Chat messages (and tools) to prompt token ids, through the model's chat template; a
    session's prompt continues the exact ids of its previous turn where its text does.

    Rendering and tokenizing run on a thread of their own, not on the event loop: an agent's
    prompt of tens of thousands of tokens takes tens of milliseconds (29 k tokens of SmolLM2:
    34 ms, mostly tokenizing), during which the loop goes on streaming other answers (the GIL is
    shared, so this spreads the work out rather than adding CPU)."""

    def __init__(self, tokenizer: Any, continuations: SessionContinuations, tool_format: str = "auto"):
        self.tokenizer = tokenizer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompts")
        self.continuations = continuations
        self.renders_tools, self.renders_calls = template_support(tokenizer)
        if not self.renders_tools:
            self.tool_format = HERMES  # the gateway writes the tool prompt, in its format
        else:
            self.tool_format = detect(tokenizer.chat_template) if tool_format == "auto" else FORMATS[tool_format]

    async def chat(self, body: ChatCompletionRequest, session: SessionInfo) -> tuple[list[int], str, str, ToolFormat | None]:
        """(prompt ids, the text they stand for, forced tool-call prefix, the tool-call format
        when tools are active)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._chat, body, session)

    async def completion(self, body: CompletionRequest, session: SessionInfo) -> tuple[list[int], str | None]:
        """(prompt ids, the text they stand for: None for a prompt given as ids)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._completion, body, session)

    def _chat(self, body: ChatCompletionRequest, session: SessionInfo) -> tuple[list[int], str, str, ToolFormat | None]:
        tools = None
        if body.tools and body.tool_choice != "none":
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
        messages = adapt_messages([m.for_template() for m in body.messages], tools, self.renders_tools, self.renders_calls)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools if self.renders_tools else None, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # the template rejected this conversation
            raise APIError(400, f"messages cannot be rendered by the chat template: {exc}", "messages") from None
        forced = self.tool_format.forced_prefix(body.tool_choice) if tools else ""
        active = self.tool_format if tools else None
        return self.continuations.encode(session.session_id, text + forced), text + forced, forced, active

    def translated(self, make: Callable[[], ChatCompletionRequest]) -> ChatCompletionRequest:
        """The chat request another API's request stands for; one it cannot stand for is a 400."""
        try:
            return make()
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise APIError(400, message, param) from None

    def _completion(self, body: CompletionRequest, session: SessionInfo) -> tuple[list[int], str | None]:
        if isinstance(body.prompt, str):
            return self.continuations.encode(session.session_id, body.prompt), body.prompt
        vocab = len(self.tokenizer)
        if not all(0 <= t < vocab for t in body.prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(body.prompt), None


def create_gateway(pool: EnginePool, tokenizer: Any, recorder: Recorder, model_name: str, config: ServeConfig,
                   context_length: int, metrics: ServeMetrics) -> FastAPI:
    """The gateway app. Operations: API keys and the admin key (`serve.api_keys`,
    `serve.admin_key`), a body size limit (413), a concurrency limit with a bounded queue
    (429 with Retry-After), a per-request timeout (504), Prometheus metrics on `/metrics`."""
    app = FastAPI(title="Flywheel gateway", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_metrics_route(app, metrics)
    install_body_limit(app, config.max_body_bytes)
    install_auth(app, config.api_keys, config.admin_key)
    install_request_metrics(app, metrics)
    stats = GatewayStats()
    app.state.stats = stats
    continuations = SessionContinuations(tokenizer, config.continue_sessions)
    prompts = PromptBuilder(tokenizer, continuations, config.tool_format)
    stored_responses = ResponseStore(config.stored_responses)
    limiter = ConcurrencyLimiter(config.max_concurrent_requests, config.max_queued_requests, config.retry_after_s)
    app.state.limiter = limiter
    metrics.on_scrape(lambda m: m.admission(limiter.active, limiter.waiting, limiter.rejected))
    metrics.on_scrape(lambda m: m.recorder(recorder.published, recorder.dropped, recorder.spilled, recorder.pending))
    metrics.on_scrape(lambda m: m.weight_versions({engine.name: engine.weight_version for engine in pool.engines}))

    def finished(generation: Generation) -> None:
        stats.turns += generation.body.n
        if generation.session.turn_type == "main" and not generation.session.anonymous:
            for choice in generation.choices:
                continuations.remember(generation.session.session_id, generation.prompt_ids + choice.output_ids,
                                       generation.continued_text(choice))
        metrics.tokens(len(generation.prompt_ids) * generation.body.n, sum(len(c.output_ids) for c in generation.choices))
        for choice in generation.choices:
            if choice.first_token_at is None:
                continue
            metrics.time_to_first_token(choice.first_token_at - generation.arrived)
            if len(choice.output_ids) > 1 and choice.last_token_at:
                metrics.time_per_output_token((choice.last_token_at - choice.first_token_at) / (len(choice.output_ids) - 1))

    async def run(body: ChatCompletionRequest | CompletionRequest, session: SessionInfo, prompt_ids: list[int],
                  prompt_text: str | None, forced: str = "", tool_format: ToolFormat | None = None,
                  wire: Wire | None = None) -> Any:
        stats.requests += 1
        if body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model", "model_not_found")
        if len(prompt_ids) >= context_length:
            raise APIError(400, f"the prompt is {len(prompt_ids)} tokens; this model's context window is {context_length}",
                           "messages" if isinstance(body, ChatCompletionRequest) else "prompt", "context_length_exceeded")
        requested = body.requested_max_tokens()
        if requested is not None and requested > config.max_new_tokens:
            if wire is None:  # chat and completions: a limit the client asked past is refused
                raise APIError(400, f"max_tokens is {requested}; the limit is {config.max_new_tokens}", "max_tokens")
            requested = config.max_new_tokens  # agents send their model's maximum (Claude Code: 32000)
        generation = Generation(
            body=body, engine=pool.route(session.session_id), tokenizer=tokenizer, recorder=recorder,
            model_name=model_name, session=session, prompt_ids=prompt_ids, prompt_text=prompt_text,
            wire=wire or OpenAIWire(isinstance(body, ChatCompletionRequest)),
            max_new_tokens=min(requested or config.default_max_new_tokens, config.max_new_tokens, context_length - len(prompt_ids)),
            forced=forced, tool_format=tool_format, on_finish=finished, timeout_s=config.request_timeout_s,
        )
        if body.stream:
            await limiter.acquire()  # a 429 must be a real status, before the stream starts
            return EventStreamResponse(generation.events(), on_close=limiter.release)
        try:
            async with request_timeout(config.request_timeout_s), limiter.slot():
                return await generation.complete()
        except EngineError as exc:
            raise APIError(exc.status, str(exc)) from None
        except RecordLost as exc:
            raise APIError(503, f"the answer could not be recorded ({exc}); send the request again", code="not_recorded") from None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": pool.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": int(stats.started_at), "owned_by": "flywheel"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        session = session_of(request.headers, body.metadata, body.user)
        return await run(body, session, *await prompts.chat(body, session))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        session = session_of(request.headers, body.metadata, body.user)
        return await run(body, session, *await prompts.completion(body, session))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        previous = None
        if body.previous_response_id is not None:
            previous = stored_responses.get(body.previous_response_id)
            if previous is None:
                raise APIError(404, f"previous response {body.previous_response_id!r} not found (never stored, or evicted)",
                               "previous_response_id", "previous_response_not_found")
        response_id = f"resp_{uuid.uuid4().hex}"
        conversation = (previous.session_id if previous else request.headers.get("session-id") or body.prompt_cache_key
                        or (response_id if body.store else None))  # a stored response may be continued
        session = session_of(request.headers, body.metadata, body.user, conversation)
        history = previous.conversation if previous else []
        chat = prompts.translated(lambda: body.to_chat(history))
        wire = ResponsesWire(body, stored_responses, response_id, session.session_id, history)
        return await run(chat, session, *await prompts.chat(chat, session), wire=wire)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> dict[str, Any]:
        stored = stored_responses.get(response_id)
        if stored is None:
            raise APIError(404, f"response {response_id!r} not found (never stored, or evicted)", "response_id", "not_found")
        return stored.response

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Any:
        conversation = request.headers.get("x-claude-code-session-id") or body.session_hint()
        session = session_of(request.headers, None, None, conversation)
        chat = prompts.translated(body.to_chat)
        return await run(chat, session, *await prompts.chat(chat, session), wire=MessagesWire(body.stop_sequences))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        chat = prompts.translated(body.to_chat)
        prompt_ids, *_ = await prompts.chat(chat, session_of({}, None, None))
        return {"input_tokens": len(prompt_ids)}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> dict[str, str]:
        """Claude Code probes `HEAD /` before it starts."""
        return {"status": "ok"}

    async def session_event(session_id: str, kind: str, feedback: FeedbackRequest | None = None) -> dict[str, Any]:
        """Record a session event; answered only once it is durable (a 200 means it is kept)."""
        event = SessionEvent(
            id=uuid.uuid4().hex,
            session_id=session_id,
            kind=kind,
            reward=feedback.reward if feedback else None,
            turn_index=feedback.turn_index if feedback else None,
            text=feedback.text if feedback else None,
            source=feedback.source if feedback else "user",
            details=feedback.details if feedback else None,
        )
        try:
            await recorder.durable(SESSION_EVENT_SUBJECT, event)
        except RecordLost as exc:
            raise APIError(503, f"the event could not be recorded ({exc}); send it again", code="not_recorded") from None
        return {"id": event.id, "object": "session.event", "session_id": session_id, "kind": kind}

    @app.post("/v1/sessions/{session_id}/feedback")
    async def feedback(session_id: str, body: FeedbackRequest) -> dict[str, Any]:
        stats.feedback += 1
        return await session_event(session_id, "feedback", body)

    @app.post("/v1/sessions/{session_id}/end")
    async def end(session_id: str) -> dict[str, Any]:
        return await session_event(session_id, "end")

    return app
