"""The OpenAI-compatible HTTP gateway: chat completions, models, and session signals.

Each completed chat request is answered from an engine (through SGLang's native protocol) and
recorded as a `Turn` with the exact prompt ids the gateway built, the output ids the engine
sampled, their behaviour logprobs and weight versions. Feedback and explicit session ends become
`SessionEvent`s. Recording goes through the `Recorder`, off the response path.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request

from bus import SESSION_EVENT_SUBJECT, TURN_SUBJECT, SessionEvent, Timings, Turn
from serve.chat import ChatCompletionRequest, completion_response, sampling_params
from serve.engine_client import EngineClient
from serve.errors import APIError, install_error_handlers
from serve.recorder import Recorder
from serve.sessions import FeedbackRequest, session_of


@dataclass
class GatewayLimits:
    max_new_tokens: int = 1024
    default_max_new_tokens: int = 256
    context_length: int = 2048


@dataclass
class GatewayStats:
    requests: int = 0
    errors: int = 0
    turns: int = 0
    feedback: int = 0
    started_at: float = field(default_factory=time.time)


def token_versions(meta: dict[str, Any], n_tokens: int) -> list[int]:
    """Per-token weight versions from `meta_info` (`weight_versions` spans, else one version)."""
    spans = meta.get("weight_versions")
    if not spans:
        return [int(meta["weight_version"])] * n_tokens
    versions = [0] * n_tokens
    for span in spans:
        versions[span["start"]:span["end"]] = [int(span["version"])] * (span["end"] - span["start"])
    return versions


def create_gateway(
    engine: EngineClient, tokenizer: Any, recorder: Recorder, model_name: str, limits: GatewayLimits
) -> FastAPI:
    app = FastAPI(title="Flywheel gateway", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    stats = GatewayStats()
    app.state.stats = stats

    def prompt_ids(request: ChatCompletionRequest) -> list[int]:
        messages = [m.for_template() for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template rejected this conversation
            raise APIError(400, f"messages cannot be rendered by the chat template: {exc}", "messages")
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= limits.context_length:
            raise APIError(
                400,
                f"the prompt is {len(ids)} tokens; this model's context window is {limits.context_length}",
                "messages",
                "context_length_exceeded",
            )
        return ids

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": int(stats.started_at), "owned_by": "flywheel"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        arrived = time.monotonic()
        stats.requests += 1
        if body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model", "model_not_found")
        session = session_of(request.headers, body.metadata, body.user)
        requested = body.requested_max_tokens()
        if requested is not None and requested > limits.max_new_tokens:
            raise APIError(400, f"max_tokens is {requested}; the limit is {limits.max_new_tokens}", "max_tokens")
        ids = prompt_ids(body)
        max_new = min(requested or limits.default_max_new_tokens, limits.context_length - len(ids))
        rid = uuid.uuid4().hex
        params = sampling_params(body, max_new)
        native = await engine.generate(
            {"input_ids": ids, "sampling_params": params, "return_logprob": True, "rid": rid}
        )
        meta = native["meta_info"]
        output_ids = native["output_ids"]
        versions = token_versions(meta, len(output_ids))
        response = completion_response(body, model_name, native, meta["weight_version"])
        recorder.record(
            TURN_SUBJECT,
            Turn(
                id=rid,
                session_id=session.session_id,
                turn_index=sum(1 for m in body.messages if m.role == "assistant"),
                turn_type=session.turn_type,
                task_id=session.task_id,
                model=model_name,
                messages=[m.model_dump(exclude_none=True) for m in body.messages],
                response=response["choices"][0]["message"],
                prompt_ids=ids,
                output_ids=output_ids,
                output_logprobs=[entry[0] for entry in meta["output_token_logprobs"]],
                output_versions=versions,
                finish_reason=response["choices"][0]["finish_reason"],
                sampling=params,
                session_done=session.done,
                timings=Timings(
                    queued_s=meta.get("queue_time", 0.0),
                    first_token_s=meta.get("first_token_latency", 0.0),
                    total_s=time.monotonic() - arrived,
                ),
            ),
        )
        stats.turns += 1
        return response

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
