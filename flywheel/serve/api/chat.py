"""Request schemas of `/v1/chat/completions` and `/v1/completions`, validated strictly
(`flywheel/serve/api/validation.py`): known OpenAI parameters with no effect here are accepted only at
their neutral value. `seed` is bounded to the signed 64-bit range. `sampling_params` turns a
request into the engine's sampling parameters for one choice.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flywheel.formats.tool_calls import JSON_STYLE
from flywheel.serve.api.validation import Body, Lenient, Strict, invalid

MAX_N = 16
MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GREEDY_BELOW = 1e-6
"""SGLang's `_SAMPLING_EPS`: a smaller temperature samples greedily (logits / temperature would
overflow)."""


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise invalid(f"{i}.type", f"content parts of type {kind!r} are not supported: this model takes text only")
        return value

    @model_validator(mode="after")
    def _has_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"{'an' if self.role == 'assistant' else 'a'} {self.role} message needs content")
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


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """`response_format`: plain text, any JSON object, or JSON matching a schema; the engine
    decodes under the schema (`json_schema` sampling parameter), so the answer always parses,
    unless `max_tokens` cuts it short."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema', and only with it")
        return self

    def constraint(self) -> str | None:
        """The engine's `json_schema` parameter for this format (None for text)."""
        if self.type == "text":
            return None
        schema = dict((self.json_schema.schema_ if self.json_schema else None) or {"type": "object"})
        schema["x-guidance"] = JSON_STYLE
        return json.dumps(schema)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Body):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    """OpenAI's and SGLang's range; choice i samples with seed + i (wrapped into the same range)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    """OpenAI's stable id of the end user (recorded as `Turn.user_id`; `X-User-Id` comes first)."""
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
    store: bool | None = None
    """OpenAI's `store`: `false` means nothing of the request is kept beyond it (served, never
    recorded, never trained); absent or `true`: as the key's tenant allows."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

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
    """SGLang `sampling_params` for one choice of a request (seeded choices get seed + index;
    temperatures below `GREEDY_BELOW` are sent, and recorded, as 0: greedy, as SGLang does)."""
    temperature = request.temperature if request.temperature >= GREEDY_BELOW else 0.0
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": request.top_p}
    if request.stop:
        params["stop"] = request.stop
    if request.seed is not None:
        params["sampling_seed"] = (request.seed + choice - INT64_MIN) % 2**64 + INT64_MIN
    if request.min_tokens:
        params["min_new_tokens"] = min(request.min_tokens, max_new_tokens)
    if request.ignore_eos:
        params["ignore_eos"] = True
    response_format = getattr(request, "response_format", None)
    if response_format is not None and response_format.constraint() is not None:
        params["json_schema"] = response_format.constraint()
    return params
