"""How one API shapes a generation's answer: whole, and as server-sent events.

A `Generation` runs the engine requests, holds back text that may be the start of a tool call,
and records the turns; a `Wire` says what the client sees. One wire object serves one request
(stream wires keep per-stream state: pre-encoded chunk templates, item ids, sequence numbers).

A stream is: `open()` once, `delta()` per engine chunk, `close()` per finished choice, then
`finish()` when every choice ended normally or `failure()` when it did not, and, only once the
turns are durable, `done()`. If they cannot be kept, `failure()` replaces `done()`: the client
never sees a successful end of an answer that was not recorded.

`OpenAIWire` is Chat Completions and legacy Completions (`[DONE]`-terminated chunks);
`flywheel.serve.api.responses_wire` and `flywheel.serve.api.messages_wire` are the Responses and Anthropic Messages APIs.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from flywheel.serve.api.formatting import (
    ChunkTemplate,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    fingerprint,
    usage,
    usage_chunk,
)
from flywheel.serve.api.sse import DONE
from flywheel.serve.engine_choice import Choice

if TYPE_CHECKING:
    from flywheel.serve.in_flight import Generation


def sse(obj: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event: `data: <json>` (after `event: <name>` when named)."""
    data = b"data: " + json.dumps(obj).encode() + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


class Wire:
    """The answer's shape for one request (see the module docstring). `endpoint` names the API
    on the recorded turn."""

    endpoint: str
    chat = True
    """Whether the request is a conversation (its turns carry messages and tool calls)."""

    def answer(self, g: Generation) -> dict[str, Any]:
        raise NotImplementedError

    def open(self, g: Generation) -> bytes:
        return b""

    def delta(self, g: Generation, choice: Choice, text: str, start: int, sent: int) -> bytes | None:
        """The event for a choice's new output (tokens from position `start`, visible `text`,
        after `sent` characters of text were sent); None when there is nothing to send yet."""
        raise NotImplementedError

    def close(self, g: Generation, choice: Choice, streamed: str) -> bytes:
        raise NotImplementedError

    def finish(self, g: Generation) -> bytes:
        return b""

    def failure(self, g: Generation, message: str, code: str | None) -> bytes:
        raise NotImplementedError

    def done(self, g: Generation) -> bytes:
        raise NotImplementedError


class OpenAIWire(Wire):
    """`chat.completion` / `text_completion` objects and their `[DONE]`-terminated chunks."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.endpoint = "chat" if chat else "completions"
        self.templates: list[ChunkTemplate] = []

    def response_id(self, g: Generation) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{g.id}"

    def answer(self, g: Generation) -> dict[str, Any]:
        choices = []
        for choice in g.choices:
            if self.chat:
                message, finish = g.message(choice)
                logprobs = chat_logprobs(g.tokenizer, choice) if g.want_logprobs else None
                choices.append({"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                logprobs = completion_logprobs(g.tokenizer, choice) if g.want_logprobs else None
                choices.append({"index": choice.index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason})
        return {
            "id": self.response_id(g),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": g.created,
            "model": g.model_name,
            "system_fingerprint": fingerprint(g.version()),
            "choices": choices,
            "usage": usage(len(g.prompt_ids), g.output_tokens()),
        }

    def open(self, g: Generation) -> bytes:
        rid = self.response_id(g)
        self.templates = [ChunkTemplate(self.chat, rid, g.created, g.model_name, c.index) for c in g.choices]
        if not self.chat:
            return b""
        return b"".join(sse(chat_chunk(rid, g.created, g.model_name, None, c.index, {"role": "assistant", "content": ""}))
                        for c in g.choices)

    def delta(self, g: Generation, choice: Choice, text: str, start: int, sent: int) -> bytes | None:
        if not self.chat:
            logprobs = completion_logprobs(g.tokenizer, choice, start, sent) if g.want_logprobs else None
            return self.templates[choice.index].event(choice.version, text, logprobs)
        logprobs = chat_logprobs(g.tokenizer, choice, start) if g.want_logprobs else None
        if not text and logprobs is None:
            return None
        return self.templates[choice.index].event(choice.version, text, logprobs)

    def close(self, g: Generation, choice: Choice, streamed: str) -> bytes:
        rid = self.response_id(g)
        if not self.chat:
            return sse(completion_chunk(rid, g.created, g.model_name, choice.version, choice.index, "", choice.finish_reason))
        message, finish = g.message(choice)
        delta: dict[str, Any] = {}
        content = message.get("content") or ""
        if content.startswith(streamed) and len(content) > len(streamed):
            delta["content"] = content[len(streamed):]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        return sse(chat_chunk(rid, g.created, g.model_name, choice.version, choice.index, delta, finish))

    def finish(self, g: Generation) -> bytes:
        if not g.body.include_usage:
            return b""
        return sse(usage_chunk(self.response_id(g), g.created, g.model_name, g.version(),
                               "chat.completion.chunk" if self.chat else "text_completion",
                               len(g.prompt_ids), g.output_tokens()))

    def failure(self, g: Generation, message: str, code: str | None) -> bytes:
        return sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})

    def done(self, g: Generation) -> bytes:
        return DONE
