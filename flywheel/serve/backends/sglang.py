"""An engine behind a URL speaking SGLang's native protocol: a real SGLang server, or
`flywheel engine`.

Streams come out as deltas: SGLang's default cumulative chunks are cut to what was not sent yet.
A server may report one weight-version label per response or chunk, so each chunk's per-token
versions are bounded by what this client knew of the engine (`flywheel.serve.engine_choice.bound_versions`):
staleness is never under-estimated.

LoRA adapters: a body's `lora_path` (one adapter name) passes through as SGLang takes it;
`load_adapter` loads a version of one (`/load_lora_adapter` with `lora_name`, `lora_path` and
`weight_version`: the embedded engine then labels the adapter's tokens `<name>@<N>`, and loads
over an earlier version; a server that refuses a name it has "already" loaded, as SGLang does,
has it unloaded first and loaded again, so the requests under way finish with the old version;
if the new one then fails to load, the old one is loaded back). A server that labels an
adapter's tokens with its base label instead has them counted as the adapter version this client
had loaded when the request began (`bound_versions`). `unload_adapter` is
`/unload_lora_adapter`; a name the server does not have (another gateway of the same engine
unloaded it first) is no error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from flywheel.serve.backends.base import EngineError
from flywheel.serve.engine_choice import bound_versions, version_of


class HTTPEngineClient:
    """An engine behind a URL: SGLang on a GPU machine, or `flywheel engine`."""

    def __init__(self, url: str, admin_key: str | None = None, timeout_s: float = 600.0):
        self.name = url.rstrip("/")
        self.weight_version = 0
        """Flywheel's version of the engine's label, as of the last `connect` or weight update."""
        self.incremental = False
        """Whether the server streams deltas (`--incremental-streaming-output`) or cumulative chunks."""
        self.adapter_versions: dict[str, int] = {}
        """The version of each adapter this client loaded into the engine (`load_adapter`)."""
        self._adapter_paths: dict[str, str] = {}
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._http = httpx.AsyncClient(base_url=self.name, headers=headers, timeout=timeout_s, limits=limits)

    async def connect(self) -> "HTTPEngineClient":
        await self.refresh_version()
        server = (await self._call("GET", "/server_info")).json()
        self.incremental = bool(server.get("incremental_streaming_output", False))
        return self

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        try:
            response = await self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(503, f"engine {self.name} unreachable: {exc}") from None
        if response.status_code >= 400:
            raise EngineError(_status(response), f"engine {self.name}: {_message(response)}")
        return response

    def _known(self, body: dict[str, Any]) -> tuple[int, str | None]:
        """The version this client knows the request's weights to have (its adapter's, with a
        `lora_path`), and the adapter."""
        adapter = body.get("lora_path")
        if isinstance(adapter, str):
            return self.adapter_versions.get(adapter, 0), adapter
        return self.weight_version, None

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        known, adapter = self._known(body)
        response = (await self._call("POST", "/generate", body)).json()
        bound_versions(response["meta_info"], len(response["output_ids"]), known, adapter)
        return response

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        text_sent, ids_sent = "", 0
        known, adapter = self._known(body)
        try:
            async with self._http.stream("POST", "/generate", json={**body, "stream": True}) as response:
                async for chunk in events(response, self.name):
                    if not self.incremental:  # SGLang's default: each chunk holds everything so far
                        chunk = _delta(chunk, text_sent, ids_sent)
                    text_sent += chunk["text"]
                    ids_sent += len(chunk["output_ids"])
                    known = bound_versions(chunk["meta_info"], len(chunk["output_ids"]), known, adapter)
                    yield chunk
        except httpx.HTTPError as exc:
            raise EngineError(503, f"engine {self.name} stream failed: {exc}") from None

    async def pause(self, mode: str) -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        reply = (await self._call("POST", "/update_weights_from_disk",
                                  {"model_path": model_path, "weight_version": str(weight_version)})).json()
        if not reply.get("success"):
            raise EngineError(503, f"engine {self.name} could not load weights: {reply.get('message')}")
        self.weight_version = weight_version

    async def load_adapter(self, name: str, path: str, version: int) -> None:
        """Serve the PEFT adapter in `path` as version `version` of adapter `name`. A server that
        refuses a name it has already is made to unload it and load the new version; if that
        fails, the version it had is loaded back."""
        try:
            try:
                await self._load_adapter(name, path, version)
            except EngineError as exc:
                previous = self._adapter_paths.get(name)
                if exc.status != 400 or previous is None or "already" not in str(exc).lower():
                    raise
                await self._call("POST", "/unload_lora_adapter", {"lora_name": name})  # SGLang's way to replace one
                try:
                    await self._load_adapter(name, path, version)
                except EngineError:
                    await self._load_adapter(name, previous, self.adapter_versions[name])
                    raise
        except EngineError as exc:
            raise EngineError(503, f"engine {self.name} could not load adapter {name} v{version}: {exc}") from None

    async def _load_adapter(self, name: str, path: str, version: int) -> None:
        await self._call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path, "weight_version": str(version)})
        self.adapter_versions[name] = version
        self._adapter_paths[name] = path

    async def unload_adapter(self, name: str) -> None:
        try:
            await self._call("POST", "/unload_lora_adapter", {"lora_name": name})
        except EngineError as exc:
            if exc.status != 400 or "does not exist" not in str(exc):
                raise
        self.adapter_versions.pop(name, None)
        self._adapter_paths.pop(name, None)

    async def refresh_version(self) -> int:
        info = (await self._call("GET", "/model_info")).json()
        self.weight_version = version_of(info.get("weight_version"))
        return self.weight_version

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})

    async def close(self) -> None:
        await self._http.aclose()


async def events(response: httpx.Response, name: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an engine's streamed response (server-sent events), up to `[DONE]`; an
    error status, or an error event, is an `EngineError`."""
    if response.status_code >= 400:
        await response.aread()
        raise EngineError(_status(response), f"engine {name}: {_message(response)}")
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            error = event["error"]
            raise EngineError(503, f"engine {name}: {error.get('message') if isinstance(error, dict) else error}")
        yield event


def _delta(chunk: dict[str, Any], text_sent: str, ids_sent: int) -> dict[str, Any]:
    """The part of a cumulative chunk not sent yet (version spans made relative to it)."""
    meta = dict(chunk["meta_info"])
    if meta.get("weight_versions"):
        meta["weight_versions"] = [
            {**span, "start": max(span["start"] - ids_sent, 0), "end": span["end"] - ids_sent}
            for span in meta["weight_versions"] if span["end"] > ids_sent
        ]
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = meta["output_token_logprobs"][ids_sent:]
    if "output_top_logprobs" in meta:
        meta["output_top_logprobs"] = meta["output_top_logprobs"][ids_sent:]
    return {**chunk, "text": chunk["text"][len(text_sent):], "output_ids": chunk["output_ids"][ids_sent:], "meta_info": meta}


def _status(response: httpx.Response) -> int:
    """An engine's error status as the gateway reports it: 400 and 500 as they are, else 503."""
    return response.status_code if response.status_code in (400, 500) else 503


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or f"HTTP {response.status_code}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(error or body.get("message") or body)
