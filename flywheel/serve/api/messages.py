"""Anthropic's Messages API request (`POST /v1/messages`) and its translation into a chat
conversation, served like any chat request (same template, tools, sampling, recording).

    system (text or text blocks)     the system message; blocks joined by a newline
    messages: role "system"          a system message where it stands (Claude Code's
                                     `mid-conversation-system` beta sends them partway through a
                                     conversation; Anthropic's public API has no such role). Kept
                                     in place, the history stays append-only: merged into the
                                     first system message, a later request's prompt no longer
                                     extends an earlier one, and the conversation splits in two.
                                     A template that refuses a system message after the first
                                     gets them merged (`flywheel/serve/prompts.py`)
              text blocks            the message's text
              tool_use               an assistant tool call (`input` as JSON arguments)
              tool_result            a tool message (before the user's text of the same message)
              thinking, redacted_thinking   dropped (this model does not think in a separate channel)
    tools (custom: name, description, input_schema)   function tools
    tool_choice auto / any / tool / none   auto / required / that function / none;
                                     `disable_parallel_tool_use` is parallel_tool_calls=false
    max_tokens, temperature, top_p, stop_sequences, stream   as in chat, except that max_tokens
                                     above `serve.max_new_tokens` is capped there, not refused
                                     (Claude Code always asks for its model's maximum, 32000)
    metadata.user_id                 kept for the session id (Claude Code puts a JSON string with
                                     `session_id` in it)
    thinking, context_management, output_config, service_tier, cache_control (top level or on
    any block), speed, inference_geo, diagnostics, user_profile_id, workspace_id
                                     accepted, no effect (the anthropic SDK 2.x sends some of
                                     these and no longer has temperature or top_p: send them in
                                     `extra_body`)

Anything else is a 400 naming the field (image or document blocks, server tools, `top_k`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from flywheel.serve.api.chat import ChatCompletionRequest
from flywheel.serve.api.validation import Body, Lenient, Strict, by_type, invalid


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


class ThinkingBlock(Lenient):
    type: Literal["thinking", "redacted_thinking"]


Block = by_type({"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                 "thinking": ThinkingBlock, "redacted_thinking": ThinkingBlock})


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        """Refuse, naming it, a block that is not text (an image, a document)."""
        for i, block in enumerate(value if isinstance(value, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in ("image", "document", "search_result"):
                raise invalid(f"{i}.type", f"content blocks of type {kind!r} are not supported: this model takes text only")
        return value

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content

    def text(self) -> str:
        return "".join(block.text for block in self.blocks() if isinstance(block, TextBlock))


class CustomTool(Lenient):
    type: Literal["custom"] = "custom"
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(Strict):
    user_id: str | None = None


class MessagesRequest(Body):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = Field(None, max_length=4)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    metadata: Metadata | None = None
    # Accepted without effect (see the module docstring).
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools_only(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type", "custom") if isinstance(tool, dict) else "custom"
            if kind != "custom":
                raise invalid(f"{i}.type", f"server tools ({kind!r}) are not supported: give client tools with an input_schema")
        return value

    def session_hint(self) -> str | None:
        """The session id inside `metadata.user_id`, where Claude Code puts one (a JSON string)."""
        user_id = self.metadata.user_id if self.metadata else None
        try:
            parsed = json.loads(user_id) if user_id else None
        except ValueError:
            return None
        session = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session if isinstance(session, str) and session else None

    def system_text(self) -> str:
        parts = [self.system] if isinstance(self.system, str) else [block.text for block in self.system or []]
        return "\n".join(parts)

    def conversation(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        system = self.system_text()
        if system:
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            if message.role == "system":
                messages.append({"role": "system", "content": message.text()})
                continue
            blocks = message.blocks()
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            results = [b for b in blocks if isinstance(b, ToolResultBlock)]
            messages += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()} for r in results]
            if message.role == "assistant" and (text or calls):
                messages.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            elif message.role == "user" and (text or not results):
                messages.append({"role": "user", "content": text})
        return messages

    def to_chat(self) -> ChatCompletionRequest:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
                 for t in self.tools or []]
        choice = self.tool_choice
        chat_choice: Any = None
        if choice is not None and tools:
            chat_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name or ""}}
        return ChatCompletionRequest(
            model=self.model, messages=self.conversation(), tools=tools or None, tool_choice=chat_choice,
            parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            stop=self.stop_sequences or None, stream=self.stream,
        )


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    max_tokens: int = Field(1, ge=1)
