"""How the gateway reaches an engine: SGLang's native protocol, whatever the transport.

The gateway only builds `/generate` bodies and reads `/generate` responses and chunks, and
drives weight swaps with `/pause_generation`, `/update_weights_from_disk` and
`/continue_generation`. `HTTPEngineClient` does that over HTTP (a real SGLang server, or
`python -m serve.engine`); `InProcessEngineClient` hands the same bodies to the same
`serve.engine.native` functions the engine's HTTP server uses, without the socket. Streams come
out of both as deltas: the HTTP client turns SGLang's default cumulative chunks into deltas.

An engine's `weight_version` here is Flywheel's integer version (`serve.choices.version_of` of
the engine's label). The in-process client reads the embedded engine's exact per-token versions;
the HTTP client, which may be talking to a server that reports one label per response or chunk,
bounds each chunk's versions by what it knew of the engine (`serve.choices.bound_versions`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx

from serve.choices import bound_versions, version_of
from serve.engine import Engine, ProtocolError, RequestFailed, generate, generate_stream


class EngineError(Exception):
    """An engine refused a request (`status` 400), failed it (500; the requests batched with it
    went on) or could not be reached (503)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineClient(Protocol):
    name: str
    weight_version: int

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None: ...

    async def refresh_version(self) -> int:
        """Ask the engine which weights it has (another gateway may have swapped them)."""
        ...

    async def abort(self, rid: str) -> None: ...

    async def close(self) -> None: ...


class InProcessEngineClient:
    """An embedded `Engine` in this process."""

    def __init__(self, engine: Engine, name: str = "embedded"):
        self.engine = engine
        self.name = name

    @property
    def weight_version(self) -> int:
        return version_of(self.engine.version)

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await generate(self.engine, body)
        except ProtocolError as exc:
            raise EngineError(400, str(exc)) from None
        except RequestFailed as exc:
            raise EngineError(500, str(exc)) from None

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in generate_stream(self.engine, body, incremental=True):
                yield chunk
        except ProtocolError as exc:
            raise EngineError(400, str(exc)) from None
        except RequestFailed as exc:
            raise EngineError(500, str(exc)) from None

    async def pause(self, mode: str) -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        await self.engine.update_weights(model_path, str(weight_version))

    async def refresh_version(self) -> int:
        return self.weight_version

    async def abort(self, rid: str) -> None:
        await self.engine.abort(rid)

    async def close(self) -> None:
        pass


class HTTPEngineClient:
    """An engine behind a URL: SGLang on a GPU machine, or `python -m serve.engine`."""

    def __init__(self, url: str, admin_key: str | None = None, timeout_s: float = 600.0):
        self.name = url.rstrip("/")
        self.weight_version = 0
        """Flywheel's version of the engine's label, as of the last `connect` or weight update."""
        self.incremental = False
        """Whether the server streams deltas (`--incremental-streaming-output`) or cumulative chunks."""
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

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        known = self.weight_version
        response = (await self._call("POST", "/generate", body)).json()
        bound_versions(response["meta_info"], len(response["output_ids"]), known)
        return response

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        text_sent, ids_sent = "", 0
        known = self.weight_version
        try:
            async with self._http.stream("POST", "/generate", json={**body, "stream": True}) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise EngineError(_status(response), f"engine {self.name}: {_message(response)}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        raise EngineError(503, f"engine {self.name}: {chunk['error'].get('message')}")
                    if not self.incremental:  # SGLang's default: each chunk holds everything so far
                        chunk = _delta(chunk, text_sent, ids_sent)
                    text_sent += chunk["text"]
                    ids_sent += len(chunk["output_ids"])
                    known = bound_versions(chunk["meta_info"], len(chunk["output_ids"]), known)
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

    async def refresh_version(self) -> int:
        info = (await self._call("GET", "/model_info")).json()
        self.weight_version = version_of(info.get("weight_version"))
        return self.weight_version

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})

    async def close(self) -> None:
        await self._http.aclose()


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
