"""SGLang's native `/generate` protocol on top of the embedded `Engine`.

`generate(engine, body)` takes the JSON body SGLang's `/generate` takes and returns the JSON it
returns (SGLang's `python/sglang/srt/entrypoints/http_server.py` and `GenerateReqInput`): `text`, `output_ids` and `meta_info` with
`finish_reason`, `weight_version`, per-token `weight_versions` spans and, with
`return_logprob`, `output_token_logprobs` as `[logprob, token_id, null]` triples (plus
`output_top_logprobs` with `top_logprobs_num`). `generate_stream` yields the chunks of a
`stream: true` request: cumulative like SGLang's default, or deltas (`incremental`, like
`--incremental-streaming-output`). The engine's HTTP server and the gateway's in-process client
both go through these functions, so what the gateway reads from an embedded engine is what it
reads from SGLang.

`lora_path` names each prompt's LoRA adapter, as in SGLang: one name (or null) for every prompt,
or a list with one entry per prompt, null for the bare base. A name the engine does not know is
SGLang's 400 (`AdapterNotFound`: "The following requested LoRA adapters are not loaded: ...").

Versions are the engine's opaque labels (a token sampled with an adapter: `<name>@<label>`, see
`core`). With `spans` (the default, like SGLang 0.5.23) a response or chunk reports what sampled
its tokens: once a request's tokens come from more than one version, `weight_versions` spans
cover the chunk's tokens (positions relative to the chunk), and `weight_version` is the label of
the chunk's last token (the engine's current label before any token, adapter or not). Without `spans` it reports only the engine's current label when the response or
chunk is produced, like a server that does not track per-token versions: a token sampled
before a swap may then be reported under the newer label (see `flywheel/serve/engine_choice.py` for how the
gateway copes).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from flywheel.serve.engine.adapters import UnknownAdapter
from flywheel.serve.engine.core import Engine
from flywheel.serve.engine.detokenizer import IncrementalText
from flywheel.serve.engine.request import GenerationResult, TokenDelta
from flywheel.serve.engine.sampling import SamplingParams
from flywheel.serve.text_pieces import TextPieces


class ProtocolError(ValueError):
    """A malformed `/generate` request (HTTP 400 `{"error": ...}`, as SGLang answers)."""


class AdapterNotFound(ProtocolError):
    """A `/generate` request named a LoRA adapter the engine does not know (HTTP 400
    `{"error": {"message": ...}}`, SGLang's shape for it)."""


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Run-length spans `{version, start, end}` over the output tokens."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def _version_meta(versions: list[str], start: int, mixed: bool, current: str, spans: bool) -> dict[str, Any]:
    """`weight_version` (and `weight_versions`) for a chunk holding a request's tokens from
    `start` on; `versions`: the labels of all its tokens so far, `mixed`: whether they differ;
    `current`: the engine's label now."""
    if not spans:
        return {"weight_version": current}
    meta: dict[str, Any] = {"weight_version": versions[-1] if versions else current}
    runs = version_spans(versions[start:]) if mixed else []
    if runs:
        meta["weight_versions"] = runs
    return meta


def _meta(rid: str, prompt_tokens: int, ids: list[int], logprobs: list[float], tops: list | None,
          finish: dict | None, return_logprob: bool, versions: dict[str, Any]) -> dict[str, Any]:
    """`meta_info` for output tokens `ids`, with `versions` from `_version_meta`."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        **versions,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(logprobs, ids)]
        meta["output_token_logprobs_length"] = len(ids)
        if tops is not None:
            meta["output_top_logprobs"] = [[[lp, tid, None] for tid, lp in position] for position in tops]
    return meta


def to_response(result: GenerationResult, engine_version: str, return_logprob: bool, return_prompt_ids: bool,
                spans: bool = True) -> dict[str, Any]:
    mixed = any(v != result.versions[0] for v in result.versions)
    meta = _meta(result.rid, len(result.prompt_ids), result.output_ids, result.logprobs, result.top_logprobs,
                 result.finish_reason, return_logprob, _version_meta(result.versions, 0, mixed, engine_version, spans))
    if return_logprob:
        scored = result.input_logprobs or []
        first = len(result.prompt_ids) - len(scored)
        meta["input_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(scored, result.prompt_ids[first:])]
        if result.input_top_logprobs is not None:
            meta["input_top_logprobs"] = [None if top is None else [[lp, tid, None] for tid, lp in top]
                                          for top in result.input_top_logprobs]
    meta.update(e2e_latency=result.total_s, queue_time=result.queued_s, first_token_latency=result.first_token_s)
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
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ProtocolError("text must be a string or a non-empty list of strings")
        return [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts], isinstance(text, list)
    ids = body["input_ids"]
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    for prompt in prompts:
        if not isinstance(prompt, list) or not all(type(t) is int and 0 <= t < engine.vocab_size for t in prompt):
            raise ProtocolError(f"input_ids must be lists of token ids in [0, {engine.vocab_size})")
    return prompts, batch


def _sampling(engine: Engine, body: dict[str, Any], i: int) -> SamplingParams:
    raw = body.get("sampling_params")
    item = raw[i] if isinstance(raw, list) and i < len(raw) else raw
    if item is not None and not isinstance(item, dict):
        raise ProtocolError("sampling_params must be an object or a list of objects")
    item = dict(item or {})
    if body.get("return_logprob") and body.get("top_logprobs_num"):
        item["top_logprobs_num"] = body["top_logprobs_num"]
    start = body.get("logprob_start_len")
    if body.get("return_logprob") and start is not None:
        item["logprob_start_len"] = start[i] if isinstance(start, list) else start
    try:
        params = SamplingParams.from_dict(item)
        constraint = engine.grammars.constraint(params)
        if constraint is not None:
            engine.grammars.serialized(*constraint)  # an invalid grammar is the client's error
    except Exception as exc:  # msgspec.ValidationError, our ValueError, GrammarError
        raise ProtocolError(f"sampling_params: {exc}") from None
    return params


def _adapters(engine: Engine, body: dict[str, Any], count: int) -> list[str | None]:
    """Each prompt's adapter name (None: the base), from `lora_path`."""
    raw = body.get("lora_path")
    names = raw if isinstance(raw, list) else [raw] * count
    if len(names) != count:
        raise ProtocolError("lora_path must have one entry per prompt")
    for name in names:
        if name is None:
            continue
        if not isinstance(name, str):
            raise ProtocolError("lora_path must be an adapter name, null, or a list of them")
        try:
            engine.adapters.require(name)
        except UnknownAdapter as exc:
            raise AdapterNotFound(str(exc)) from None
    return names


Work = tuple[list[int], SamplingParams, str | None, str | None]
"""One prompt's ids, sampling parameters, rid and adapter name."""


def _requests(engine: Engine, body: dict[str, Any]) -> tuple[list[Work], bool]:
    prompts, batch = _prompts(engine, body)
    rid = body.get("rid") or uuid.uuid4().hex
    rids = rid if isinstance(rid, list) else [f"{rid}-{i}" if batch else rid for i in range(len(prompts))]
    if len(rids) != len(prompts):
        raise ProtocolError("rid must have one entry per prompt")
    for prompt in prompts:
        if len(prompt) >= engine.context_length:
            raise ProtocolError(f"prompt has {len(prompt)} tokens; the context window is {engine.context_length}")
    adapters = _adapters(engine, body, len(prompts))
    return [(p, _sampling(engine, body, i), r, a) for i, (p, r, a) in enumerate(zip(prompts, rids, adapters))], batch


async def generate(engine: Engine, body: dict[str, Any], spans: bool = True) -> dict[str, Any] | list[dict[str, Any]]:
    """Serve one non-streaming `/generate` body; raises ProtocolError for a request SGLang
    would reject, and `RequestFailed` for one that failed in the engine."""
    if body.get("stream"):
        raise ProtocolError("use generate_stream for stream=true")
    requests, batch = _requests(engine, body)
    results = await asyncio.gather(*(engine.generate(p, s, r, a) for p, s, r, a in requests))
    responses = [
        to_response(r, engine.version, bool(body.get("return_logprob")), bool(body.get("return_prompt_token_ids")), spans)
        for r in results
    ]
    return responses if batch else responses[0]


class _TextStream:
    """Text of a growing output, decoded incrementally and released only where it can no longer
    change: not the end of an unfinished UTF-8 character (`IncrementalText`), nor what could
    still turn out to be part of a stop string (the last `hold` characters). Each step costs
    the new text, not the output so far."""

    def __init__(self, tokenizer: Any, params: SamplingParams):
        self._text = IncrementalText(tokenizer, params.skip_special_tokens)
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self._pending = ""  # decoded, not yet released
        self._sent = TextPieces()

    def advance(self, ids: list[int]) -> str:
        self._pending += self._text.added(ids)
        count = len(self._pending) - self.hold
        if count <= 0:
            return ""
        delta, self._pending = self._pending[:count], self._pending[count:]
        return self._release(delta)

    def finish(self, final_text: str) -> str:
        return self._release(final_text[self._sent.length:])

    def _release(self, delta: str) -> str:
        self._sent.append(delta)
        return delta

    @property
    def sent(self) -> str:
        """All the text released so far."""
        return self._sent.text


def generate_stream(engine: Engine, body: dict[str, Any], incremental: bool = False,
                    spans: bool = True) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streaming `/generate` request (one prompt); the last has `finish_reason`.
    A request SGLang would reject raises ProtocolError here, before any chunk; one that fails in
    the engine raises `RequestFailed` from the iteration."""
    requests, batch = _requests(engine, body)
    if batch:
        raise ProtocolError("streaming takes one prompt, not a batch")
    return _chunks(engine, *requests[0], bool(body.get("return_logprob")), incremental, spans)


async def _chunks(engine: Engine, prompt: list[int], params: SamplingParams, rid: str, adapter: str | None,
                  return_logprob: bool, incremental: bool, spans: bool) -> AsyncIterator[dict[str, Any]]:
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[str] = []
    mixed = False
    tops: list | None = [] if params.top_logprobs_num else None
    text = _TextStream(engine.tokenizer, params)
    async for item in engine.stream(prompt, params, rid, adapter):
        start = len(ids)
        if isinstance(item, TokenDelta):
            ids += item.token_ids
            logprobs += item.logprobs
            if not mixed:
                first = (versions or item.versions)[0]
                mixed = any(v != first for v in item.versions)
            versions += item.versions
            if tops is not None:
                tops += item.top_logprobs or []
            delta_text, finish = text.advance(ids), None
        else:
            delta_text, finish = text.finish(item.text), item.finish_reason
        cut = start if incremental else 0
        meta = _meta(rid, len(prompt), ids[cut:], logprobs[cut:], tops[cut:] if tops is not None else None,
                     finish, return_logprob, _version_meta(versions, cut, mixed, engine.version, spans))
        meta["completion_tokens"] = len(ids)
        yield {"text": delta_text if incremental else text.sent, "output_ids": ids[cut:], "meta_info": meta}
