"""The `/v1/chat/completions` request schema, prompt building and response shaping.

Requests are validated strictly: a parameter the gateway does not implement is a 400 naming it,
never silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (content flattened to a string)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool) -> bool:
        if value:
            raise ValueError("stream=true is not supported yet")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def sampling_params(request: ChatCompletionRequest, max_new_tokens: int) -> dict[str, Any]:
    """SGLang `sampling_params` for a chat request."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
    }
    if request.stop:
        params["stop"] = request.stop
    if request.seed is not None:
        params["sampling_seed"] = request.seed
    return params


FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def completion_response(
    request: ChatCompletionRequest, model_name: str, native: dict[str, Any], version: str
) -> dict[str, Any]:
    """An OpenAI `chat.completion` object from a native `/generate` response."""
    meta = native["meta_info"]
    prompt_tokens, completion_tokens = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": f"flywheel-v{version}",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": native["text"]},
                "logprobs": None,
                "finish_reason": FINISH_REASONS[meta["finish_reason"]["type"]],
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
