"""SGLang's native `/generate` protocol on top of the embedded `Engine`.

`generate(engine, body)` takes the JSON body SGLang's `/generate` takes and returns the JSON it
returns (see `shared/reference/sglang-api.md`, A.1): `text`, `output_ids` and `meta_info` with
`finish_reason`, `weight_version`, per-token `weight_versions` spans and, with
`return_logprob`, `output_token_logprobs` as `[logprob, token_id, null]` triples. The HTTP
server and the gateway's in-process client both go through this one function, so the protocol
the gateway speaks to an embedded engine is byte for byte what it speaks to SGLang.
"""

from __future__ import annotations

import asyncio
from typing import Any

from serve.engine.core import Engine, GenerationResult
from serve.engine.sampling import SamplingParams


class ProtocolError(ValueError):
    """A malformed `/generate` request (HTTP 400 `{"error": ...}`, as SGLang answers)."""


def version_spans(versions: list[int]) -> list[dict[str, Any]]:
    """Run-length spans `{version, start, end}` over the output tokens."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(version), "start": i, "end": i + 1})
    return spans


def to_response(result: GenerationResult, engine_version: int, return_logprob: bool, return_prompt_ids: bool) -> dict[str, Any]:
    spans = version_spans(result.versions)
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": spans[-1]["version"] if spans else str(engine_version),
        "e2e_latency": result.total_s,
        "queue_time": result.queued_s,
        "first_token_latency": result.first_token_s,
    }
    if len(spans) > 1:
        meta["weight_versions"] = spans
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(result.logprobs, result.output_ids)]
        meta["output_token_logprobs_length"] = len(result.output_ids)
    response: dict[str, Any] = {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}
    if return_prompt_ids:
        response["prompt_token_ids"] = result.prompt_ids
    return response


def _prompts(engine: Engine, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """The prompt token ids of a request, and whether it was a batch."""
    given = [key for key in ("text", "input_ids", "input_embeds") if body.get(key) is not None]
    if len(given) != 1:
        raise ProtocolError("give exactly one of text, input_ids or input_embeds")
    if given[0] == "input_embeds":
        raise ProtocolError("input_embeds is not supported by the embedded engine")
    if given[0] == "text":
        text = body["text"]
        texts = text if isinstance(text, list) else [text]
        if not all(isinstance(t, str) for t in texts):
            raise ProtocolError("text must be a string or a list of strings")
        return [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts], isinstance(text, list)
    ids = body["input_ids"]
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    vocab = len(engine.tokenizer)
    for prompt in prompts:
        if not isinstance(prompt, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ProtocolError(f"input_ids must be lists of token ids in [0, {vocab})")
    return prompts, batch


def _sampling(raw: Any, i: int) -> SamplingParams:
    item = raw[i] if isinstance(raw, list) else raw
    if item is not None and not isinstance(item, dict):
        raise ProtocolError("sampling_params must be an object or a list of objects")
    try:
        return SamplingParams.from_dict(item)
    except Exception as exc:  # msgspec.ValidationError or our ValueError
        raise ProtocolError(f"sampling_params: {exc}") from None


async def generate(engine: Engine, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
    """Serve one `/generate` body; raises ProtocolError for a request SGLang would reject."""
    if body.get("stream"):
        raise ProtocolError("stream=true is not supported by the embedded engine yet")
    prompts, batch = _prompts(engine, body)
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [f"{rid}-{i}" if rid and batch else rid for i in range(len(prompts))]
    params = [_sampling(body.get("sampling_params"), i) for i in range(len(prompts))]
    try:
        results = await asyncio.gather(
            *(engine.generate(p, s, r) for p, s, r in zip(prompts, params, rids))
        )
    except ValueError as exc:  # e.g. prompt beyond the context window
        raise ProtocolError(str(exc)) from None
    responses = [
        to_response(r, engine.version, bool(body.get("return_logprob")), bool(body.get("return_prompt_token_ids")))
        for r in results
    ]
    return responses if batch else responses[0]
