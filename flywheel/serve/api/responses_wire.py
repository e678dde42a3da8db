"""The Responses API's answer: the `response` object, its event stream, and stored responses.

The output of one generation is a `message` item with one `output_text` part (when the model
wrote text outside tool calls) and one `function_call` item per call. The stream is the
sequence the official SDKs and Codex CLI read, every event named (`event:`) and numbered
(`sequence_number`):

    response.created, response.in_progress
    response.output_item.added (message), response.content_part.added,
        response.output_text.delta ..., response.output_text.done, response.content_part.done,
        response.output_item.done
    per call: response.output_item.added (function_call), response.function_call_arguments.delta,
        response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens), with usage

`response.completed` goes out only once the turn is durable; a failure is `response.failed`.
Text streams as the model writes it; a tool call is sent whole when the answer ends (the
gateway cannot know a call is complete before that).

`ResponseStore` keeps each tenant's last `capacity` stored responses in memory (this gateway's,
not shared across replicas; one tenant's traffic never evicts another's): the object for
`GET /v1/responses/{id}`, and the conversation and session a `previous_response_id` continues.
Forgetting a tenant or a user drops theirs, and every response whose chain one of theirs began or
went through (its conversation holds their words).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flywheel.lru import LRU
from flywheel.serve.api.responses import ResponsesRequest
from flywheel.serve.api.wire import Wire, sse
from flywheel.serve.engine_choice import Choice
from flywheel.tenants.forgotten import forgets

if TYPE_CHECKING:
    from flywheel.serve.api.sessions import SessionInfo
    from flywheel.serve.in_flight import Generation


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    session_id: str
    """The session as the client named it (a continuation names it again, for its tenant)."""
    tenant: str
    users: frozenset[str | None]
    """The end users who asked in its chain (forgetting one of them forgets it)."""
    conversation: list[dict[str, Any]]
    """The chain's chat messages up to and including this response's output (no instructions)."""


class ResponseStore:
    """The stored responses, by tenant (`serve.stored_responses` of each tenant's, least recently
    used forgotten first; 0 stores none)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._tenants: dict[str, LRU[str, StoredResponse]] = {}

    def put(self, stored: StoredResponse) -> None:
        self._tenants.setdefault(stored.tenant, LRU(self.capacity))[stored.response["id"]] = stored

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The stored response, if `tenant` stored it (another tenant's is not there for it)."""
        items = self._tenants.get(tenant)
        return items.get(response_id) if items is not None else None

    def forget(self, tenant: str, user: str | None = None) -> int:
        """Drop the tenant's stored responses (only those `user` asked in the chain of, if given);
        how many went."""
        items = self._tenants.get(tenant)
        if items is None:
            return 0
        if user is None:
            return len(self._tenants.pop(tenant))
        gone = [key for key in items if any(forgets((tenant, user), (tenant, u)) for u in items.peek(key).users)]
        for key in gone:
            items.pop(key)
        return len(gone)


def _usage(g: Generation) -> dict[str, Any]:
    prompt, output = len(g.prompt_ids), g.output_tokens()
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesWire(Wire):
    endpoint = "responses"

    def __init__(self, request: ResponsesRequest, store: ResponseStore, response_id: str, session: SessionInfo,
                 previous: StoredResponse | None):
        """`session.store`: whether anything of the request may be kept (its tenant's, key's and own
        `store`); `previous`: the stored response it continues."""
        self.request, self.store, self.id, self.session, self.previous = request, store, response_id, session, previous
        self.history = previous.conversation if previous else []
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0
        self.message_open = False
        self.items: list[dict[str, Any]] = []
        """Output items sent whole so far (stream), in order."""

    # ---- the response object ---------------------------------------------------------------

    def _response(self, g: Generation, status: str, output: list[dict[str, Any]], error: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id, "object": "response", "created_at": g.created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": g.model_name,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id, "reasoning": r.reasoning, "store": r.store,
            "temperature": r.temperature,
            "text": r.text.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else {"format": {"type": "text"}},
            "tool_choice": r.tool_choice if isinstance(r.tool_choice, str) else r.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []], "top_p": r.top_p,
            "truncation": r.truncation or "disabled", "metadata": r.metadata or {}, "user": r.user,
            "usage": _usage(g) if status in ("completed", "incomplete") else None,
        }

    def _output(self, g: Generation, choice: Choice) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
        """(output items, status, the assistant's chat message) of the finished choice."""
        message, finish = g.message(choice)
        items: list[dict[str, Any]] = []
        if message.get("content"):
            items.append({"type": "message", "id": self.message_id, "status": "completed", "role": "assistant",
                          "content": [_text_part(message["content"])]})
        for call in message.get("tool_calls") or []:
            items.append({"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"})
        return items, "incomplete" if finish == "length" else "completed", message

    def _finished(self, g: Generation) -> dict[str, Any]:
        items, status, message = self._output(g, g.choices[0])
        response = self._response(g, status, items)
        if self.request.store and self.session.store and not g.forgotten():
            conversation = self.history + self.request.conversation() + [message]
            session = self.session
            users = (self.previous.users if self.previous else frozenset()) | {session.user_id}
            self.store.put(StoredResponse(response, session.client_id, session.tenant, users, conversation))
        return response

    def answer(self, g: Generation) -> dict[str, Any]:
        return self._finished(g)

    # ---- the stream ------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(event, kind)

    def _message_item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def _open_message(self) -> bytes:
        self.message_open = True
        return (self._event("response.output_item.added", output_index=0, item=self._message_item("in_progress", []))
                + self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                              part=_text_part("")))

    def _text_delta(self, text: str) -> bytes:
        return self._event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def open(self, g: Generation) -> bytes:
        response = self._response(g, "in_progress", [])
        return self._event("response.created", response=response) + self._event("response.in_progress", response=response)

    def delta(self, g: Generation, choice: Choice, text: str, start: int, sent: int) -> bytes | None:
        if not text:
            return None
        return (b"" if self.message_open else self._open_message()) + self._text_delta(text)

    def close(self, g: Generation, choice: Choice, streamed: str) -> bytes:
        items, _, _ = self._output(g, choice)
        if self.message_open and not any(item["type"] == "message" for item in items):  # streamed text was only space
            items.insert(0, self._message_item("completed", [_text_part(streamed)]))
        out = b""
        for item in items:
            index = len(self.items)
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if not self.message_open:
                    out += self._open_message()
                if text.startswith(streamed) and len(text) > len(streamed):
                    out += self._text_delta(text[len(streamed):])
                out += self._event("response.output_text.done", item_id=self.message_id, output_index=index, content_index=0,
                                   text=text, logprobs=[])
                out += self._event("response.content_part.done", item_id=self.message_id, output_index=index, content_index=0,
                                   part=_text_part(text))
            else:
                out += self._event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
                out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
                out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"])
            out += self._event("response.output_item.done", output_index=index, item=item)
            self.items.append(item)
        return out

    def failure(self, g: Generation, message: str, code: str | None) -> bytes:
        error = {"code": code or "server_error", "message": message}
        return self._event("response.failed", response=self._response(g, "failed", self.items, error))

    def done(self, g: Generation) -> bytes:
        response = self._finished(g)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=response)
