"""Anthropic's Messages API answer: the `message` object and its event stream.

The content is a `text` block (when the model wrote text outside tool calls) and one `tool_use`
block per call (`input`: the call's arguments; arguments that are not a JSON object come as
`{"arguments": <value>}`). The stream, every event named, as Anthropic's SDK and Claude Code
dispatch on the name:

    message_start
    content_block_start (text), content_block_delta (text_delta) ..., content_block_stop
    per call: content_block_start (tool_use), content_block_delta (input_json_delta), content_block_stop
    message_delta (stop_reason, usage)
    message_stop                       only once the turn is durable; a failure is an `error` event

Text streams as the model writes it; a tool call is sent whole when the answer ends.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from flywheel.serve.api.errors import anthropic_error
from flywheel.serve.api.formatting import stop_string
from flywheel.serve.api.wire import Wire, sse
from flywheel.serve.engine_choice import Choice

if TYPE_CHECKING:
    from flywheel.serve.in_flight import Generation

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


class MessagesWire(Wire):
    endpoint = "messages"

    def __init__(self, stop_sequences: list[str] | None):
        self.stop_sequences = stop_sequences or []
        self.id = f"msg_{uuid.uuid4().hex}"
        self.text_open = False
        self.blocks = 0

    def _content(self, g: Generation, choice: Choice) -> list[dict[str, Any]]:
        message, _ = g.message(choice)
        content: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        content += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": _input(call["function"]["arguments"])}
                    for call in message.get("tool_calls") or []]
        return content

    def _stop(self, g: Generation, choice: Choice) -> tuple[str, str | None]:
        _, finish = g.message(choice)
        matched = stop_string(choice)
        if matched is not None and matched in self.stop_sequences:
            return "stop_sequence", matched
        return STOP_REASONS.get(finish, "end_turn"), None

    def _usage(self, g: Generation) -> dict[str, int]:
        return {"input_tokens": len(g.prompt_ids), "output_tokens": g.output_tokens(),
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def answer(self, g: Generation) -> dict[str, Any]:
        choice = g.choices[0]
        reason, sequence = self._stop(g, choice)
        return {"id": self.id, "type": "message", "role": "assistant", "model": g.model_name,
                "content": self._content(g, choice), "stop_reason": reason, "stop_sequence": sequence, "usage": self._usage(g)}

    # ---- the stream ------------------------------------------------------------------------

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, kind)

    def _start_block(self, block: dict[str, Any]) -> bytes:
        return self._event("content_block_start", index=self.blocks, content_block=block)

    def _end_block(self) -> bytes:
        self.blocks += 1
        return self._event("content_block_stop", index=self.blocks - 1)

    def _text(self, text: str) -> bytes:
        return self._event("content_block_delta", index=self.blocks, delta={"type": "text_delta", "text": text})

    def open(self, g: Generation) -> bytes:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": g.model_name, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {**self._usage(g), "output_tokens": 0}}
        return self._event("message_start", message=message)

    def delta(self, g: Generation, choice: Choice, text: str, start: int, sent: int) -> bytes | None:
        if not text:
            return None
        head = b""
        if not self.text_open:
            self.text_open = True
            head = self._start_block({"type": "text", "text": ""})
        return head + self._text(text)

    def close(self, g: Generation, choice: Choice, streamed: str) -> bytes:
        out = b""
        content = self._content(g, choice)
        text = content[0]["text"] if content and content[0]["type"] == "text" else ""
        if text or self.text_open:
            if not self.text_open:
                out += self._start_block({"type": "text", "text": ""})
            if text.startswith(streamed) and len(text) > len(streamed):
                out += self._text(text[len(streamed):])
            out += self._end_block()
            self.text_open = False
        for block in content:
            if block["type"] == "tool_use":
                out += self._start_block({**block, "input": {}})
                out += self._event("content_block_delta", index=self.blocks,
                                   delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                out += self._end_block()
        reason, sequence = self._stop(g, choice)
        return out + self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                 usage={"output_tokens": g.output_tokens()})

    def failure(self, g: Generation, message: str, code: str | None) -> bytes:
        return self._event("error", error=anthropic_error(500, message)["error"])

    def done(self, g: Generation) -> bytes:
        return self._event("message_stop")
