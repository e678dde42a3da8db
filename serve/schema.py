"""Request schemas of `/v1/chat/completions` and `/v1/completions`, validated strictly.

A parameter the gateway does not implement is a 400 naming it, never silently ignored: the
models forbid unknown keys, and known OpenAI parameters with no effect here are accepted only at
their neutral value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_TOP_LOGPROBS = 20


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (content flattened to a string)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class FunctionSpec(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: dict[str, str]

    @property
    def name(self) -> str:
        return self.function.get("name", "")


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = Field(0, ge=0)
    """SGLang / vLLM extension (send it in `extra_body`): no end-of-sequence before this many tokens."""
    ignore_eos: bool = False
    """SGLang / vLLM extension: generate to `max_tokens` whatever the model's end tokens say."""

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("frequency and presence penalties are not supported; leave them at 0")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "Sampling":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice requires tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among tools")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(min_length=1)
    """A text prompt, or the token ids of one."""
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("best_of is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value


def sampling_params(request: Sampling, max_new_tokens: int, choice: int) -> dict[str, Any]:
    """SGLang `sampling_params` for one choice of a request (seeded choices get seed + index)."""
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": request.temperature, "top_p": request.top_p}
    if request.stop:
        params["stop"] = request.stop
    if request.seed is not None:
        params["sampling_seed"] = request.seed + choice
    if request.min_tokens:
        params["min_new_tokens"] = min(request.min_tokens, max_new_tokens)
    if request.ignore_eos:
        params["ignore_eos"] = True
    return params
