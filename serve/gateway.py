"""The OpenAI-compatible HTTP gateway: chat and text completions, models, session signals.

The gateway renders chat templates and tokenizes once; those prompt ids, and the output ids,
logprobs and weight versions the engine returns, are what each recorded `Turn` carries. It
reaches engines only through SGLang's native protocol (`EnginePool` / `EngineClient`).
Feedback and explicit session ends become `SessionEvent`s. Recording goes through the
`Recorder`, off the response path.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request

from bus import SESSION_EVENT_SUBJECT, SessionEvent
from serve.engine_client import EngineError
from serve.engine_pool import EnginePool
from serve.errors import APIError, install_error_handlers
from serve.generation import Generation
from serve.recorder import Recorder
from serve.schema import ChatCompletionRequest, CompletionRequest
from serve.sessions import FeedbackRequest, session_of
from serve.sse import EventStreamResponse
from serve.tools import adapt_messages, forced_prefix, template_support


@dataclass
class GatewayLimits:
    max_new_tokens: int = 1024
    default_max_new_tokens: int = 256
    context_length: int = 2048


@dataclass
class GatewayStats:
    requests: int = 0
    turns: int = 0
    feedback: int = 0
    started_at: float = field(default_factory=time.time)


class PromptBuilder:
    """Chat messages (and tools) to prompt token ids, through the model's chat template."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.renders_tools, self.renders_calls = template_support(tokenizer)

    def chat(self, body: ChatCompletionRequest) -> tuple[list[int], str, bool]:
        """(prompt ids, forced tool-call prefix, whether tool calls are parsed)."""
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
        forced = forced_prefix(body.tool_choice) if tools else ""
        return self.tokenizer.encode(text + forced, add_special_tokens=False), forced, tools is not None

    def completion(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            return self.tokenizer.encode(body.prompt, add_special_tokens=False)
        vocab = len(self.tokenizer)
        if not all(0 <= t < vocab for t in body.prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(body.prompt)


def create_gateway(pool: EnginePool, tokenizer: Any, recorder: Recorder, model_name: str, limits: GatewayLimits) -> FastAPI:
    app = FastAPI(title="Flywheel gateway", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    stats = GatewayStats()
    app.state.stats = stats
    prompts = PromptBuilder(tokenizer)

    def finished(generation: Generation) -> None:
        stats.turns += generation.body.n

    async def run(body: ChatCompletionRequest | CompletionRequest, request: Request, prompt_ids: list[int],
                  forced: str = "", tools_active: bool = False) -> Any:
        stats.requests += 1
        if body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model", "model_not_found")
        if len(prompt_ids) >= limits.context_length:
            raise APIError(400, f"the prompt is {len(prompt_ids)} tokens; this model's context window is {limits.context_length}",
                           "messages" if isinstance(body, ChatCompletionRequest) else "prompt", "context_length_exceeded")
        requested = body.requested_max_tokens()
        if requested is not None and requested > limits.max_new_tokens:
            raise APIError(400, f"max_tokens is {requested}; the limit is {limits.max_new_tokens}", "max_tokens")
        session = session_of(request.headers, body.metadata, body.user)
        generation = Generation(
            body=body, engine=pool.route(session.session_id), tokenizer=tokenizer, recorder=recorder,
            model_name=model_name, session=session, prompt_ids=prompt_ids,
            max_new_tokens=min(requested or limits.default_max_new_tokens, limits.context_length - len(prompt_ids)),
            forced=forced, tools_active=tools_active, on_finish=finished,
        )
        if body.stream:
            return EventStreamResponse(generation.events())
        try:
            return await generation.complete()
        except EngineError as exc:
            raise APIError(exc.status, str(exc)) from None

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
        prompt_ids, forced, tools_active = prompts.chat(body)
        return await run(body, request, prompt_ids, forced, tools_active)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await run(body, request, prompts.completion(body))

    def session_event(session_id: str, kind: str, feedback: FeedbackRequest | None = None) -> dict[str, Any]:
        event = SessionEvent(
            id=uuid.uuid4().hex,
            session_id=session_id,
            kind=kind,
            reward=feedback.reward if feedback else None,
            turn_index=feedback.turn_index if feedback else None,
            text=feedback.text if feedback else None,
            source=feedback.source if feedback else "user",
        )
        recorder.record(SESSION_EVENT_SUBJECT, event)
        return {"id": event.id, "object": "session.event", "session_id": session_id, "kind": kind}

    @app.post("/v1/sessions/{session_id}/feedback")
    async def feedback(session_id: str, body: FeedbackRequest) -> dict[str, Any]:
        stats.feedback += 1
        return session_event(session_id, "feedback", body)

    @app.post("/v1/sessions/{session_id}/end")
    async def end(session_id: str) -> dict[str, Any]:
        return session_event(session_id, "end")

    return app
