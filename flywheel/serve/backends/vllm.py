"""An engine behind a URL that is a vLLM server, driven through its online-RL endpoints.

The gateway speaks SGLang's protocol to its engines (`flywheel.serve.backends.base`); this client
translates. A `/generate` body becomes vLLM's token-in/token-out `/inference/v1/generate`
(`output_mode: text`: the token ids, their text with stop strings held back and trimmed as
SGLang does, and per-token log-probs), and the answer comes back as SGLang's `/generate`
response or delta chunks. Weight swaps: `/pause?mode=keep&clear_cache=false` (running requests
freeze in place, their KV kept: vLLM 0.32's default `clear_cache=true`, documented as ignored with
`keep`, preempts them all and recomputes them after `/resume`: an 8 s stall for 32 SmolLM2 streams),
`/collective_rpc` calling the workers' `reload_weights` with the weight store's directory (the
path that works on the CPU build: `/update_weights` needs a weight-transfer engine, NCCL or
IPC, that a directory on disk is not; with Flywheel's worker extension loaded, its
`flywheel_reload_weights`, which also refreshes tied output layers the CPU build would leave on
the old weights: `vllm_ext/flywheel_worker.py`), in `retract` mode `/reset_prefix_cache` with
`reset_running_requests` (running requests are preempted and recomputed under the new weights),
`/update_weight_version`, `/resume`. Aborts: `/abort_requests`.

The server must run with `VLLM_SERVER_DEV_MODE=1` (the RL and RPC endpoints),
`--enable-scale-out` (`/inference/v1/generate`), `--logprobs-mode processed_logprobs` (a
token's log-prob is log softmax(logits / T) at its temperature, as SGLang and the trainer have
it; vLLM's default is the untempered distribution) and `--return-tokens-as-token-ids` (top
log-probs name token ids); `flywheel.serve.backends.vllm_server` starts it so. vLLM's top log-probs list
the sampled token first, so k + 1 are asked for and the k most likely kept.

**Which version sampled a token.** vLLM labels each engine step's outputs with its current
weight-version label, but reports the spans only on a request's final output (the whole answer,
or a stream's last chunk). Labels are exact here because a swap loads the weights and sets the
label while the engine is paused (see below for the order). So:

- a whole answer, and a stream's last chunk, carry vLLM's spans: exact per token;
- a stream's earlier chunks carry none, and their tokens get the oldest version the engine can
  have had since the request was sent: the version this client knew then, lowered by every
  version it loaded (or learned, `refresh_version`) before the chunk arrived. The gateway learns
  a version only after the engine loaded it, so nothing older can have sampled them, whichever
  way versions move (a promotion's rollback loads an older one). Streams that straddle a swap
  therefore count their tokens before the last chunk as the older version (as chunks that
  straddle a swap do with SGLang, `flywheel.serve.engine_choice`).

A swap sets the label after loading the weights when the version grows, before when it shrinks,
so even an engine that is not paused never labels a token newer than its weights.

While this client swaps (pause to resume), new requests wait for it to finish, so a request is
never sent under a version that is about to change.

LoRA adapters: each version is loaded under a name of its own, `<name>@v<version>`
(`/v1/load_lora_adapter`), and a body's `lora_path` becomes the request's `model`, the version
this client loaded last. The version before stays loaded (a lagging gateway's client still names
it), the one before that is unloaded; a version another client loaded counts as loaded. Not
vLLM's in-place load: vLLM 0.32 keeps `load_inplace` on the stored request and reloads the
adapter whenever it sees it (#33791, open), and an in-place load keeps the old weights'
prefix-cache blocks (#42125); never-reused names are what its RFC #48312 recommends. vLLM labels every token with its base weights'
label, so an adapter's tokens count as the adapter version this client had loaded when the
request was sent (tests/test_vllm_lora.py). Each request's prefix-cache entries are salted with
the base version and the adapter's (`cache_salt`), so a prompt is never continued from KV
computed by older weights that vLLM kept cached (in `in_place` mode the cache is not reset: the
running requests hold their blocks, and the salt already keeps new requests off the old ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from flywheel.serve.backends.base import EngineError
from flywheel.serve.backends.sglang import HTTPEngineClient, events
from flywheel.serve.engine_choice import version_of

log = logging.getLogger(__name__)

GENERATE = "/inference/v1/generate"
TOKEN_ID = "token_id:"
"""How `--return-tokens-as-token-ids` names a token in log-prob entries."""
REQUEST_PREFIX = "generate-tokens-"
"""vLLM's prefix to the request id a `/inference/v1/generate` body names."""
_SAME = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p", "stop": "stop",
         "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
         "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
         "no_stop_trim": "include_stop_str_in_output"}
"""SGLang sampling parameters and their vLLM names."""
_GRAMMARS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar", "structural_tag": "structural_tag"}
"""SGLang's constraints and vLLM's `structured_outputs` keys."""


class VLLMEngineClient(HTTPEngineClient):
    """A vLLM server (its CPU build here, its GPU build in production). Shares the HTTP transport
    (`_call`, the admin key, `close`) with the SGLang client; the protocol is translated."""

    def __init__(self, url: str, admin_key: str | None = None, timeout_s: float = 600.0):
        super().__init__(url, admin_key, timeout_s)
        self.context_length = 0
        """The server's `max_model_len`, as of `connect`."""
        self._not_swapping = asyncio.Event()
        self._not_swapping.set()
        self._mode = "in_place"
        self._reload = "flywheel_reload_weights"
        """The workers' method that reloads weights from a directory (`connect` finds out)."""
        self._floors: set[_Floor] = set()
        """Requests in flight, each with the oldest version the engine had since it was sent."""
        self._served: dict[str, str] = {}
        """Each adapter's name in vLLM: `<name>@v<version>` of the version loaded last."""
        self._older: dict[str, str] = {}
        """Each adapter's version before that, still loaded in vLLM."""

    async def connect(self) -> "VLLMEngineClient":
        await self.refresh_version()
        models = (await self._call("GET", "/v1/models")).json()["data"]
        self.context_length = int(models[0]["max_model_len"])
        try:
            await self._call("POST", "/collective_rpc", {"method": "flywheel_extension"})
        except EngineError:
            log.warning("vLLM at %s runs without Flywheel's worker extension: weight reloads use its own "
                        "reload_weights (on the CPU build that leaves tied output layers on the old weights)", self.name)
            self._reload = "reload_weights"
        return self

    async def refresh_version(self) -> int:
        try:
            info = (await self._call("GET", "/weight_info")).json()
        except EngineError as exc:
            raise EngineError(exc.status, f"{exc} (is the vLLM server running with VLLM_SERVER_DEV_MODE=1?)") from None
        self._learn(version_of(info.get("weight_version")))
        return self.weight_version

    def _learn(self, version: int) -> None:
        """The engine has `version` now: requests in flight may get tokens from it."""
        self.weight_version = version
        for floor in self._floors:
            floor.version = min(floor.version, version)

    # ---- generation ------------------------------------------------------------------------

    async def _request(self, body: dict[str, Any], stream: bool) -> tuple[dict[str, Any], "_Floor"]:
        """vLLM's body for an SGLang `/generate` body, once no swap is under way, and its floor
        (registered: the caller removes it when the request ends)."""
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise EngineError(400, "the vLLM engine client takes token ids (input_ids), not text")
        for key in ("logprob_start_len", "return_text_in_logprobs"):
            if body.get(key) not in (None, -1, False):
                raise EngineError(400, f"{key} is not supported by the vLLM engine client")
        params = sampling(body.get("sampling_params") or {})
        top_n = int(body.get("top_logprobs_num") or 0)
        if body.get("return_logprob") or top_n:
            params["logprobs"] = top_n + 1 if top_n else 0  # vLLM lists the sampled token first
        await self._not_swapping.wait()
        floor = _Floor(self.weight_version)
        self._floors.add(floor)
        request = {"token_ids": ids, "request_id": body.get("rid") or uuid.uuid4().hex, "sampling_params": params,
                   "output_mode": "text", "stream": stream, "cache_salt": f"flywheel-v{floor.version}"}
        adapter = body.get("lora_path")
        if isinstance(adapter, str):  # vLLM's way to ask for a LoRA adapter: the model is its name
            floor.adapter = self.adapter_versions.get(adapter, 0)
            request["model"] = self._served.get(adapter, adapter)
            request["cache_salt"] = _salt(request["cache_salt"], adapter, floor.adapter)
        return request, floor

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        request, floor = await self._request(body, stream=False)
        try:
            reply = (await self._call("POST", GENERATE, request)).json()
            return _chunk(reply["choices"][0], _top_n(body), floor.known, len(request["token_ids"]), 0,
                          floor.adapter is None)
        finally:
            self._floors.discard(floor)

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        request, floor = await self._request(body, stream=True)
        top_n, sent = _top_n(body), 0
        try:
            async with contextlib.AsyncExitStack() as stack:
                response = await self._open_stream(stack, request)
                async for event in events(response, self.name):
                    for choice in event.get("choices") or []:
                        chunk = _chunk(choice, top_n, floor.known, len(request["token_ids"]), sent, floor.adapter is None)
                        sent += len(chunk["output_ids"])
                        yield chunk
        except httpx.HTTPError as exc:
            raise EngineError(503, f"engine {self.name} stream failed: {exc}") from None
        finally:
            self._floors.discard(floor)

    async def _open_stream(self, stack: contextlib.AsyncExitStack, request: dict[str, Any]) -> httpx.Response:
        try:
            return await stack.enter_async_context(self._http.stream("POST", GENERATE, json=request))
        except _DROPPED:  # see `_call`
            return await stack.enter_async_context(self._http.stream("POST", GENERATE, json=request))

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """The SGLang client's call, sent once more (on a new connection) when the server had
        closed the kept-alive one: vLLM's server drops a connection after an endpoint raised (a
        failed `/collective_rpc`), and the next request on it failed, a swap's `/resume` too,
        which left the engine paused."""
        try:
            return await super()._call(method, path, body)
        except EngineError as exc:
            if not isinstance(exc.__context__, _DROPPED):
                raise
        return await super()._call(method, path, body)

    # ---- control ---------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        """Freeze generation (`keep`: running requests stay where they are; SGLang's `abort` aborts
        them); new requests wait in this client until `resume`."""
        if mode not in ("in_place", "retract", "abort"):
            raise EngineError(400, f"unknown pause mode {mode!r} (in_place, retract or abort)")
        self._mode = mode
        self._not_swapping.clear()
        try:
            await self._call("POST", f"/pause?mode={'abort' if mode == 'abort' else 'keep'}&clear_cache=false")
        except BaseException:
            self._not_swapping.set()
            raise

    async def resume(self) -> None:
        try:
            await self._call("POST", "/resume", {})
        finally:
            self._not_swapping.set()

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        """Reload the weights from `model_path` (a Hugging Face directory); in `retract` mode drop
        the prefix cache and the running requests' KV, which vLLM then recomputes. The
        label `str(weight_version)` goes on after the load when the version grows, before it
        when it shrinks, so it never names weights newer than those loaded."""
        older = weight_version < self.weight_version
        if older:
            await self._label(weight_version)
        try:
            await self._call("POST", "/collective_rpc", {"method": self._reload, "kwargs": {"weights_path": model_path}})
        except EngineError as exc:
            raise EngineError(503, f"engine {self.name} could not load weights from {model_path}: {exc}") from None
        if self._mode == "retract":
            reset = (await self._call("POST", "/reset_prefix_cache?reset_running_requests=true")).json()
            if not reset.get("success"):
                raise EngineError(503, f"engine {self.name} could not recompute running requests under the new weights")
        if not older:
            await self._label(weight_version)

    async def _label(self, version: int) -> None:
        await self._call("POST", "/update_weight_version", {"new_version": str(version)})
        self._learn(version)

    async def load_adapter(self, name: str, path: str, version: int) -> None:
        """Load version `version` of LoRA adapter `name` as `<name>@v<version>`, keep the version
        before loaded and unload the one before that (see the module docstring; the server needs `--enable-lora` and
        `VLLM_ALLOW_RUNTIME_LORA_UPDATING`). vLLM labels an adapter's tokens with its base label:
        they count as the version loaded when their request was sent (`_Floor.adapter`)."""
        served, previous = f"{name}@v{version}", self._served.get(name)
        if served == previous:
            return
        try:
            await self._call("POST", "/v1/load_lora_adapter", {"lora_name": served, "lora_path": path})
        except EngineError as exc:
            if exc.status != 400 or "already been loaded" not in str(exc):  # else another client loaded it
                raise EngineError(503, f"engine {self.name} could not load adapter {name} v{version}: {exc}") from None
        self._served[name] = served
        self.adapter_versions[name] = version
        oldest = self._older.pop(name, None)
        if previous is not None:
            self._older[name] = previous
        if oldest is not None:
            await self._unload(oldest)

    async def _unload(self, served: str) -> None:
        """Unload the adapter vLLM knows as `served`; one it does not have (another client
        unloaded it) is no error, and one it could not unload stays loaded, unused."""
        try:
            await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": served})
        except EngineError as exc:
            if "cannot be found" not in str(exc):
                log.warning("engine %s could not unload adapter %s: %s", self.name, served, exc)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (its loaded version, `/v1/unload_lora_adapter`); a request
        naming it afterwards is refused by vLLM; one not loaded is no error."""
        self.adapter_versions.pop(name, None)
        for served in (self._served.pop(name, None), self._older.pop(name, None)):
            if served is not None:
                await self._unload(served)

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_requests", {"request_ids": [REQUEST_PREFIX + rid]})


_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError)
"""How a request on a connection the server had closed fails."""


class _Floor:
    """The oldest version an engine had while one request was in flight."""

    __slots__ = ("adapter", "version")

    def __init__(self, version: int):
        self.version = version
        self.adapter: int | None = None
        """With a LoRA adapter, the adapter's version this client had loaded when it was sent."""

    @property
    def known(self) -> int:
        """The version the request's tokens count as: the adapter's, else the floor."""
        return self.version if self.adapter is None else self.adapter


def sampling(params: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `sampling_params` for SGLang's; a parameter vLLM cannot take is a 400 naming it."""
    out: dict[str, Any] = {}
    grammars = {}
    for key, value in params.items():
        if value is None:
            continue
        if key in _SAME:
            out[_SAME[key]] = value
        elif key == "top_k":
            out["top_k"] = -1 if value in ("all", -1) or value >= 1 << 30 else value
        elif key in _GRAMMARS:
            grammars[_GRAMMARS[key]] = json.loads(value) if key == "json_schema" and isinstance(value, str) else value
        else:
            raise EngineError(400, f"sampling_params.{key} is not supported by the vLLM engine client")
    if out.get("max_tokens", 1) < 1:
        raise EngineError(400, "sampling_params.max_new_tokens must be at least 1 with vLLM")
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    if grammars:
        out["structured_outputs"] = grammars
    return out


def _salt(salt: str, adapter: str, version: int) -> str:
    """A request's prefix-cache salt with its adapter's version in it: vLLM takes at most 128
    characters, none of them `@`, `/`, `\\` or NUL (a long name goes in as its hash)."""
    named = f"{salt}-lora-{adapter}-v{version}"
    if len(named) <= 128 and not any(c in named for c in "@/\\\0"):
        return named
    return f"{salt}-lora-{hashlib.sha256(adapter.encode()).hexdigest()[:32]}-v{version}"


def _top_n(body: dict[str, Any]) -> int:
    return int(body.get("top_logprobs_num") or 0)


def _chunk(choice: dict[str, Any], top_n: int, known: int, prompt_tokens: int, sent: int,
           spans: bool = True) -> dict[str, Any]:
    """One vLLM choice (a whole answer, or a stream's delta after `sent` tokens) as SGLang's
    `/generate` response or delta chunk, with versions as the module docstring says (without
    `spans`, an adapter's request: vLLM's spans are its base weights' labels, and every token is
    `known`, the adapter's version)."""
    if choice.get("finish_reason") == "error":
        raise EngineError(500, f"vLLM failed the request: {choice.get('stop_reason')}")
    ids = list(choice.get("token_ids") or [])
    meta: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent + len(ids),
                            "weight_version": str(known), "finish_reason": _finish(choice, sent + len(ids))}
    content = (choice.get("logprobs") or {}).get("content")
    if content is not None:
        if len(content) != len(ids):
            raise EngineError(500, f"vLLM returned {len(content)} log-probs for {len(ids)} tokens")
        meta["output_token_logprobs"] = [[entry["logprob"], token, None] for entry, token in zip(content, ids)]
        if top_n:
            meta["output_top_logprobs"] = [_top(entry, top_n) for entry in content]
    if spans and choice.get("weight_versions") and ids:  # absolute spans over the whole output, this chunk's part
        meta["weight_versions"] = [
            {"version": span["version"], "start": max(span["start"] - sent, 0), "end": span["end"] - sent}
            for span in choice["weight_versions"] if span["end"] > sent
        ]
    return {"text": choice.get("text") or "", "output_ids": ids, "meta_info": meta}


def _top(entry: dict[str, Any], n: int) -> list[list[Any]]:
    """The `n` most likely tokens at one position, SGLang's `[logprob, id, None]` entries."""
    tops = []
    for top in entry.get("top_logprobs") or []:
        token = top["token"]
        if not token.startswith(TOKEN_ID):
            raise EngineError(500, "vLLM named top log-prob tokens by text: start it with --return-tokens-as-token-ids")
        tops.append([top["logprob"], int(token[len(TOKEN_ID):]), None])
    return sorted(tops, key=lambda top: -top[0])[:n]


def _finish(choice: dict[str, Any], n_tokens: int) -> dict[str, Any] | None:
    """SGLang's finish_reason object for vLLM's `finish_reason` and `stop_reason`."""
    reason = choice.get("finish_reason")
    if reason is None:
        return None
    if reason == "stop":
        matched = choice.get("stop_reason")
        if matched is None and choice.get("token_ids"):
            matched = choice["token_ids"][-1]  # an end token (vLLM reports none)
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": n_tokens}
    return {"type": "abort", "message": str(choice.get("stop_reason") or reason)}
