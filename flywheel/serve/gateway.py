"""The HTTP gateway: OpenAI's chat and text completions and Responses, Anthropic's Messages,
models, session signals.

This module assembles the app (operations middleware, metrics, routes); the routes are thin.
A request's prompt is built once (`flywheel/serve/prompts.py`: the chat template rendered and tokenized,
continuing the session's exact ids); `flywheel/serve/answerer.py` checks it against the model and its
limits and runs the `Generation` (`flywheel/serve/in_flight.py`) on the engine the session routes to,
through SGLang's native protocol (`flywheel/serve/backends/`). The prompt ids, and the output ids,
logprobs and weight versions the engine returns, are what each recorded `Turn` carries. With
`adapters.kind: lora` a request is answered by its tenant's or end user's LoRA adapter, or one its
`model` names (`<served model>:<adapter>`): flywheel/serve/adapter_routing.py.
Feedback and explicit session ends become `SessionEvent`s, answered once durable.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request, Response

from flywheel.bus import SESSION_EVENT_SUBJECT, SessionEvent
from flywheel.config.schema import ServeConfig
from flywheel.serve.adapter_routing import AdapterRouting
from flywheel.serve.answerer import Answerer
from flywheel.serve.api.chat import ChatCompletionRequest, CompletionRequest
from flywheel.serve.api.errors import APIError, install_error_handlers, translated
from flywheel.serve.api.messages import CountTokensRequest, MessagesRequest
from flywheel.serve.api.messages_wire import MessagesWire
from flywheel.serve.api.responses import ResponsesRequest
from flywheel.serve.api.responses_wire import ResponseStore, ResponsesWire
from flywheel.serve.api.sessions import FeedbackRequest, SessionInfo, header_text, session_of
from flywheel.serve.backends.pool import EnginePool
from flywheel.serve.continuation import SessionContinuations
from flywheel.serve.ops.auth import install_auth
from flywheel.serve.ops.limits import ConcurrencyLimiter, install_body_limit
from flywheel.serve.ops.metrics import (
    ServeMetrics,
    install_metrics_route,
    install_request_metrics,
)
from flywheel.serve.ops.tenants import TenantDirectory
from flywheel.serve.personal_data import PersonalData
from flywheel.serve.prompts import PromptBuilder
from flywheel.serve.recorder import Recorder, RecordLost
from flywheel.serve.scoring_server import install_scoring_routes
from flywheel.serve.served_memory import ServedMemory
from flywheel.tenants.forgotten import Forgettings
from flywheel.tenants.sessions import SessionRegistry, SessionUnknown


def create_gateway(pool: EnginePool, tokenizer: Any, recorder: Recorder, model_name: str, config: ServeConfig,
                   context_length: int, metrics: ServeMetrics, tenants: TenantDirectory,
                   sessions: SessionRegistry, adapters: AdapterRouting | None = None, teaches: bool = False,
                   memory: ServedMemory | None = None) -> FastAPI:
    """The gateway app. Operations: tenants' API keys and the admin key (`tenants`,
    `serve.api_keys`, `serve.admin_key`), a body size limit (413), a concurrency limit with a
    bounded queue (429 with Retry-After), a per-request timeout (504), Prometheus metrics on
    `/metrics`. Every session is its tenant's (`request.state.tenant`), and feedback or an end
    names one its tenant opened (`sessions`), else it is a 404. `adapters`: which LoRA adapter
    answers each request (`adapters.kind: lora`; None: the shared weights answer all). `memory`:
    each person's instructions, put in their chat requests (`memory.enabled`, `memory.placement`)."""
    app = FastAPI(title="Flywheel gateway", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_metrics_route(app, metrics)
    install_body_limit(app, config.max_body_bytes)
    install_auth(app, tenants, config.admin_key, config.metrics_key)
    install_request_metrics(app, metrics)
    continuations = SessionContinuations(tokenizer, config.continue_sessions)
    prompts = PromptBuilder(tokenizer, continuations, config.tool_format)
    stored_responses = ResponseStore(config.stored_responses)
    forgettings = Forgettings()

    def forget_cached(tenant: str, user: str | None, at: float | None = None) -> None:
        """Drop what this gateway holds in memory of a forgotten tenant or user, forgotten at Unix
        time `at` (None: now): the tenant's session continuations (all of them, for one user too:
        they are not kept by user; the cost is tokenizing whole prompts again), their stored
        responses and their instructions (`memory`)."""
        continuations.forget(tenants.session(tenant, ""))
        stored_responses.forget(tenant, user)
        forgettings.add(tenant, user, time.monotonic())  # a request's `arrived` is on that clock
        if memory is not None:
            memory.forget(tenant, user, time.time() if at is None else at)
    app.state.forget_cached = forget_cached
    limiter = ConcurrencyLimiter(config.max_concurrent_requests, config.max_queued_requests, config.retry_after_s)
    personal_data = app.state.personal_data = PersonalData()
    metrics.on_scrape(lambda m: m.personal_data(personal_data.dropped, personal_data.redacted))
    answerer = Answerer(pool, tokenizer, recorder, model_name, config, context_length, metrics, continuations, limiter,
                        sessions, personal_data, adapters, forgettings, prompts, memory.best_of if memory is not None else 1)

    def guarded(body: Any, session: SessionInfo) -> tuple[Any, SessionInfo]:
        """The request as the model sees it: its prompt redacted under `redact_input`, then its
        person's instructions added (the session says which, for its turns' record)."""
        if session.pii == "redact_input":
            body = personal_data.redact_request(body, session.tenant, session.pii_entities)
        if memory is None:
            return body, session
        body, served = memory.applied(body, session)
        return body, replace(session, **served._asdict()) if served.instructions or served.opening else session
    stats = app.state.stats = answerer.stats
    app.state.limiter = limiter
    app.state.prompts = prompts  # closed by the serve loop once the server has stopped
    metrics.on_scrape(lambda m: m.admission(limiter.active, limiter.waiting, limiter.rejected))
    metrics.on_scrape(lambda m: m.recorder(recorder.published, recorder.dropped, recorder.spilled, recorder.pending))
    metrics.on_scrape(lambda m: m.weight_versions({engine.name: engine.weight_version for engine in pool.engines}))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": pool.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": int(stats.started_at), "owned_by": "flywheel"}],
        }

    def caller(request: Request) -> dict[str, Any]:
        """Whose request this is and what its key may do, for `session_of`."""
        return {"grant": request.state.grant, "tenants": tenants}

    def client_store(store: bool | None) -> bool | None:
        """The request's own `store`, unless the gateway is told to ignore it."""
        return store if config.client_store == "honour" else None

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, response: Response) -> Any:
        session = session_of(request.headers, body.metadata, body.user, safety_identifier=body.safety_identifier,
                             store=client_store(body.store), **caller(request))
        body, session = guarded(body, session)
        return await answerer.answer(request, response.headers, body, session, *await prompts.chat(body, session))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, response: Response) -> Any:
        session = session_of(request.headers, body.metadata, body.user, safety_identifier=body.safety_identifier,
                             **caller(request))
        body, session = guarded(body, session)
        return await answerer.answer(request, response.headers, body, session, *await prompts.completion(body, session))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request, response: Response) -> Any:
        previous = None
        if body.previous_response_id is not None:
            previous = stored_responses.get(body.previous_response_id, request.state.tenant)
            if previous is None:
                raise APIError(404, f"previous response {body.previous_response_id!r} not found (never stored, or evicted)",
                               "previous_response_id", "previous_response_not_found")
        response_id = f"resp_{uuid.uuid4().hex}"
        conversation = (previous.session_id if previous else request.headers.get("session-id") or body.prompt_cache_key
                        or (response_id if body.store else None))  # a stored response may be continued
        session = session_of(request.headers, body.metadata, body.user, conversation,
                             safety_identifier=body.safety_identifier, store=client_store(body.store), **caller(request))
        chat, session = guarded(translated(lambda: body.to_chat(previous.conversation if previous else [])), session)
        wire = ResponsesWire(body, stored_responses, response_id, session, previous)
        return await answerer.answer(request, response.headers, chat, session, *await prompts.chat(chat, session), wire=wire)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> dict[str, Any]:
        stored = stored_responses.get(response_id, request.state.tenant)
        if stored is None:
            raise APIError(404, f"response {response_id!r} not found (never stored, or evicted)", "response_id", "not_found")
        return stored.response

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request, response: Response) -> Any:
        conversation = header_text(request.headers, "x-claude-code-session-id") or body.session_hint()
        session = session_of(request.headers, None, None, conversation,
                             safety_identifier=body.metadata.user_id if body.metadata else None, **caller(request))
        chat, session = guarded(translated(body.to_chat), session)
        return await answerer.answer(request, response.headers, chat, session, *await prompts.chat(chat, session),
                                     wire=MessagesWire(body.stop_sequences))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
        """The prompt's tokens as the model would see it (redacted, its person's instructions added)."""
        session = session_of(request.headers, None, None, **caller(request))
        prompt_ids, *_ = await prompts.chat(guarded(translated(body.to_chat), session)[0], session_of({}, None, None))
        return {"input_tokens": len(prompt_ids)}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> dict[str, str]:
        """Claude Code probes `HEAD /` before it starts."""
        return {"status": "ok"}

    async def session_event(request: Request, session_id: str, kind: str,
                            feedback: FeedbackRequest | None = None) -> dict[str, Any]:
        """Record a session event of the caller's tenant's session `session_id`; answered only
        once it is durable (a 200 means it is kept)."""
        tenant = request.state.tenant
        namespaced = tenants.session(tenant, session_id)
        try:
            opened = await sessions.exists(namespaced)
        except SessionUnknown as exc:
            raise APIError(503, f"whether the session exists cannot be told now ({exc}); send it again",
                           code="not_recorded") from None
        if not opened:
            raise APIError(404, f"session {session_id!r} not found", "session_id", "session_not_found")
        event = SessionEvent(
            id=uuid.uuid4().hex,
            session_id=namespaced,
            tenant=tenant,
            kind=kind,
            reward=feedback.reward if feedback else None,
            turn_index=feedback.turn_index if feedback else None,
            interaction_id=feedback.interaction_id if feedback else None,
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
    async def feedback(session_id: str, body: FeedbackRequest, request: Request) -> dict[str, Any]:
        stats.feedback += 1
        return await session_event(request, session_id, "feedback", body)

    @app.post("/v1/sessions/{session_id}/end")
    async def end(session_id: str, request: Request) -> dict[str, Any]:
        return await session_event(request, session_id, "end")

    if config.role != "policy" or teaches:  # `teaches`: the policy's base is the judge's teacher (its score route only)
        install_scoring_routes(app, pool, prompts, model_name, loads_weights=config.role == "eval",
                               generates=config.role != "policy")
    return app

