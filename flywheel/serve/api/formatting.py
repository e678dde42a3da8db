"""OpenAI response objects: chat completions, text completions, their stream chunks, logprobs.

`system_fingerprint` is `flywheel-v{N}`: the weight version that produced the answer (the
version of its last token).
"""

from __future__ import annotations

import json
import json.encoder
from typing import Any

from flywheel.formats.tool_calls import ToolFormat
from flywheel.serve.engine_choice import Choice


def fingerprint(version: int | None) -> str | None:
    return None if version is None else f"flywheel-v{version}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _token(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer: Any, choice: Choice, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion for output tokens [start, end)."""
    content = []
    for i in range(start, len(choice.output_ids) if end is None else end):
        text, raw = _token(tokenizer, choice.output_ids[i])
        tops = []
        for token_id, logprob in (choice.top_logprobs[i] if choice.top_logprobs else []):
            top_text, top_raw = _token(tokenizer, token_id)
            tops.append({"token": top_text, "logprob": logprob, "bytes": top_raw})
        content.append({"token": text, "logprob": choice.logprobs[i], "bytes": raw, "top_logprobs": tops})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Any, choice: Choice, start: int = 0, text_offset: int = 0) -> dict[str, Any]:
    """`choices[].logprobs` of a text completion (the legacy shape) for tokens from `start`."""
    tokens, offsets, tops = [], [], []
    offset = text_offset
    for i in range(start, len(choice.output_ids)):
        text, _ = _token(tokenizer, choice.output_ids[i])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if choice.top_logprobs is not None:
            tops.append({_token(tokenizer, t)[0]: lp for t, lp in choice.top_logprobs[i]})
    return {
        "tokens": tokens,
        "token_logprobs": choice.logprobs[start:],
        "top_logprobs": tops if choice.top_logprobs is not None else None,
        "text_offset": offsets,
    }


def stop_string(choice: Choice) -> str | None:
    """The stop string that ended a choice, if one did."""
    matched = (choice.finish or {}).get("matched")
    return matched if isinstance(matched, str) else None


def output_text(choice: Choice, tool_format: ToolFormat | None = None) -> str:
    """The choice's text as the client gets it: the engine's, cut before a stop string, except
    that a call the gateway ended at its closing tag (`parallel_tool_calls: false`) keeps it."""
    stop = tool_format.single_call_stop if tool_format else None
    return choice.text + stop if stop and stop_string(choice) == stop else choice.text


def chat_message(choice: Choice, tool_format: ToolFormat | None, forced: str = "") -> tuple[dict[str, Any], str]:
    """The assistant message of a finished choice and its finish reason; `tool_format` is None
    when no tools are active."""
    text = forced + output_text(choice, tool_format)
    if tool_format is not None:
        content, calls = tool_format.parse(text)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        call = tool_format.truncated_call(forced, output_text(choice, tool_format)) if forced else None
        if call is not None:  # a forced call that max_tokens cut short
            return {"role": "assistant", "content": None, "tool_calls": [call]}, choice.finish_reason
    return {"role": "assistant", "content": text}, choice.finish_reason


def chat_chunk(rid: str, created: int, model: str, version: int | None, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "system_fingerprint": fingerprint(version),
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, created: int, model: str, version: int | None, obj: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fingerprint(version),
        "choices": [], "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(rid: str, created: int, model: str, version: int | None, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": fingerprint(version),
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


_HOLES = ("\x00fingerprint\x00", "\x00text\x00", "\x00logprobs\x00")
_encode_str = json.encoder.encode_basestring_ascii  # json.dumps(str), without the encoder object


class ChunkTemplate:
    """The server-sent event of a stream chunk of one choice, pre-encoded: only the fingerprint,
    the text and the logprobs change from chunk to chunk, so the rest is encoded once per
    stream. `event(...)` gives exactly the bytes of `b"data: " + json.dumps(chunk) + b"\\n\\n"`
    for the `chat_chunk` with delta `{"content": text}` (or the `completion_chunk` with `text`)
    and no finish reason."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, index: int):
        make = chat_chunk if chat else completion_chunk
        probe = make(rid, created, model, None, index, {"content": _HOLES[1]} if chat else _HOLES[1], None, _HOLES[2])
        probe["system_fingerprint"] = _HOLES[0]
        encoded = "data: " + json.dumps(probe) + "\n\n"
        parts = []
        for hole in _HOLES:
            before, encoded = encoded.split(json.dumps(hole))
            parts.append(before.encode())
        parts.append(encoded.encode())
        self._parts = parts
        self._fingerprints: dict[int | None, bytes] = {}

    def event(self, version: int | None, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        fp = self._fingerprints.get(version)
        if fp is None:
            fp = self._fingerprints[version] = json.dumps(fingerprint(version)).encode()
        p = self._parts
        return b"".join((p[0], fp, p[1], _encode_str(text).encode(), p[2],
                         b"null" if logprobs is None else json.dumps(logprobs).encode(), p[3]))
