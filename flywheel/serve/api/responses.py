"""The Responses API request (`POST /v1/responses`) and its translation into a chat conversation.

A Responses request becomes the `ChatCompletionRequest` the gateway already serves: the same
chat template, tool prompt, forced tool calls, sampling, exact-token continuation and recording.
What maps where:

    instructions                     a system message first (not carried along a chain)
    input: a string                  one user message
    input items: message             a message (`developer` renders as system); text parts
                                     (`input_text`, `output_text`) joined
                 function_call       an assistant tool call (joined to the assistant text before it)
                 function_call_output  a tool message
                 reasoning           dropped (this model does not reason in a separate channel)
    tools: function                  shown to the model
           custom, namespace, web_search, web_search_preview, tool_search
                                     accepted and not shown (Codex CLI sends them on every request;
                                     the model cannot call them)
    tool_choice, parallel_tool_calls, max_output_tokens, temperature, top_p, metadata, user
                                     as in chat, except that max_output_tokens above
                                     `serve.max_new_tokens` is capped there, not refused
    previous_response_id             the stored conversation of that response, then this input;
                                     the chain is one session
    text.format                      chat's response_format (text, json_object, json_schema)
    reasoning, include, text.verbosity, client_metadata, prompt_cache_key, truncation,
    service_tier, safety_identifier, prompt_cache_retention, store, background=false
                                     accepted, no effect on the answer (`store` keeps it for
                                     `previous_response_id` and `GET /v1/responses/{id}`)

Anything else is a 400 naming the field: a request model that forbids unknown keys, content
parts that are not text, tool types no well-known client sends, an unknown `text.format`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from flywheel.serve.api.chat import ChatCompletionRequest
from flywheel.serve.api.validation import Body, Lenient, Strict, by_type, invalid

IGNORED_TOOLS = ("custom", "namespace", "web_search", "web_search_preview", "tool_search")
"""Tool types accepted and not shown to the model (see the module docstring)."""
TEXT_PARTS = ("input_text", "output_text", "text")


class Part(Lenient):
    type: str
    text: str = ""


def _text(content: str | list[Part], at: str = "content") -> str:
    if isinstance(content, str):
        return content
    for i, part in enumerate(content):
        if part.type not in TEXT_PARTS and part.type != "refusal":
            raise invalid(f"{i}.type", f"content parts of type {part.type!r} are not supported: this model takes text only")
    return "".join(part.text for part in content if part.type in TEXT_PARTS)


TextContent = Annotated[str | list[Part], AfterValidator(_text)]
"""A string, or text parts joined into one (other parts are refused, naming them)."""


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: TextContent


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: TextContent


class ReasoningItem(Lenient):
    type: Literal["reasoning"]


Item = by_type({"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
                "reasoning": ReasoningItem}, default="message")


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class IgnoredTool(Lenient):
    type: Literal[IGNORED_TOOLS]


Tool = by_type({"function": FunctionTool, **{kind: IgnoredTool for kind in IGNORED_TOOLS}})


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    """`text.format`: text, or JSON (any object, or matching `schema`) as chat's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema_,
                                                           "strict": self.strict}}
        return {"type": self.type}


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(Body):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted without effect on the answer (see the module docstring).
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    text: TextConfig | None = None
    client_metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    background: Literal[False] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "ResponsesRequest":
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input must not be empty")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in {t.name for t in self.functions()}:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among the function tools")
        if self.tool_choice == "required" and not self.functions():
            raise ValueError("tool_choice 'required' needs a function tool")
        return self

    def functions(self) -> list[FunctionTool]:
        return [t for t in self.tools or [] if isinstance(t, FunctionTool)]

    def conversation(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (without the instructions)."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.content})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this stands for, after `history` (a stored chain's conversation)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        functions = self.functions()
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in functions]
        choice: Any = self.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        return ChatCompletionRequest(
            model=self.model, messages=system + history + self.conversation(),
            tools=tools or None, tool_choice=choice if tools else None, parallel_tool_calls=self.parallel_tool_calls,
            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            stream=self.stream, metadata=self.metadata, user=self.user,
            response_format=self.text.format.response_format() if self.text and self.text.format else None,
        )

