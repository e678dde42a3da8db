"""The embedded engine as an HTTP server speaking SGLang's native protocol.

Routes and reply shapes follow SGLang's HTTP server (`sglang/srt/entrypoints/http_server.py`): `/generate` (JSON, or
server-sent events with `stream: true`), `/pause_generation`, `/continue_generation`,
`/update_weights_from_disk`, `/update_weight_version`, `/abort_request`, `/flush_cache`,
`/model_info` (and `/get_model_info`), `/health`, `/health_generate`, `/v1/loads`,
`/server_info`, `/load_lora_adapter`, `/unload_lora_adapter`. Control routes need the admin key
when one is set.

LoRA adapters as SGLang serves them: `/generate` takes `lora_path` (an adapter name per prompt,
see `native`; an unknown one is a 400 `{"error": {"message": ...}}`), `/load_lora_adapter` takes
`{"lora_name", "lora_path"}` (a PEFT directory) and `/unload_lora_adapter` `{"lora_name"}`, both
answering SGLang's `{"success", "error_message", "loaded_adapters": {name: path}}`, 400 when
`success` is false. Differences: loading a name already loaded is not refused but serves the new
directory as the name's new version, from the next decode step on (rows under way included, see
`core`), labelled with the optional `weight_version` if given (else counted); a name may not be
the served model's (a judge or teacher asking for the base would get the adapter); `pinned`
adapters are not supported. Names not loaded are also looked up under the engine's adapter root
(`serve.lora_root`).

The weight version is an opaque string label, as in SGLang: the engine's starting label, then
whatever string `/update_weights_from_disk` (`weight_version`, optional: without it the label
stays) or `/update_weight_version` (`new_version`) names. With `version_spans` (the default)
responses say which version sampled each token; without it (`--no-version-spans`) they carry
only the label current when the response or chunk is produced, like a server that does not
track per-token versions (see `native`).

A request that fails inside the engine (`RequestFailed`; the requests batched with it go on)
answers 500 `{"error": {"message", "type", "code"}}`, or, streaming, ends its stream with an
error event; a malformed request is a 400 `{"error": ...}` before any event.

One deliberate difference: `/update_weights_from_disk` on a server that is not paused does not
wait for in-flight requests to drain; the engine loads the weights between two decode steps and
the requests go on, their later tokens labelled with the new version.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from flywheel.models.lora_adapter import AdapterError
from flywheel.serve.api.sse import DONE, EventStreamResponse
from flywheel.serve.engine import native
from flywheel.serve.engine.core import Engine
from flywheel.serve.engine.native import AdapterNotFound, ProtocolError
from flywheel.serve.engine.request import RequestFailed
from flywheel.serve.ops.auth import ADMIN_PATHS, bearer_token, key_matches


class AdminOnly:
    """Control routes need `Bearer <admin key>`; a refusal is SGLang's 401 `{"error": "Unauthorized"}`.
    Pure ASGI: Starlette's `@app.middleware("http")` would pipe every streamed `/generate` chunk
    through a memory stream and a task group of its own."""

    def __init__(self, app: ASGIApp, admin_key: str):
        self.app = app
        self.keys = [admin_key.encode()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in ADMIN_PATHS and not key_matches(bearer_token(Headers(scope=scope)), self.keys):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _ok(message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})


def _fail(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=status)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    return body


def _adapters_reply(loaded: dict[str, str], error: str | None = None) -> JSONResponse:
    """SGLang's answer to `/load_lora_adapter` and `/unload_lora_adapter` (its `LoRAUpdateOutput`)."""
    body = {"success": error is None, "error_message": error or "", "loaded_adapters": loaded}
    return JSONResponse(body, status_code=200 if error is None else 400)


def _error(exc: Exception, code: int) -> dict[str, Any]:
    return {"error": {"message": str(exc), "type": type(exc).__name__, "code": code, "retryable": False}}


def _label(body: dict[str, Any], key: str) -> str | None:
    """The version label a control body names, if any: any string (a number is taken as its
    decimal text). Raises ValueError for anything else."""
    label = body.get(key)
    if label is None or isinstance(label, str):
        return label
    if isinstance(label, int) and not isinstance(label, bool):
        return str(label)
    raise ValueError(f"{key} must be a string")


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The chunks as events; the last one (it has a finish reason, or is an error) goes out in
    one write with `[DONE]`."""
    async def events() -> AsyncIterator[bytes]:
        tail = b""
        try:
            async for chunk in chunks:
                event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
                if chunk["meta_info"]["finish_reason"] is None:
                    yield event
                else:
                    tail = event
        except Exception as exc:  # reported in-band: the status line is already sent
            tail += b"data: " + json.dumps(_error(exc, 500)).encode() + b"\n\n"
        yield tail + DONE

    return events()


def create_engine_app(
    engine: Engine,
    model_path: str,
    served_model_name: str,
    admin_key: str | None = None,
    incremental_streaming: bool = False,
    version_spans: bool = True,
) -> FastAPI:
    app = FastAPI(title="Flywheel engine (SGLang protocol)", docs_url=None, redoc_url=None)
    started = time.time()

    if admin_key:
        app.add_middleware(AdminOnly, admin_key=admin_key)

    @app.exception_handler(ProtocolError)
    async def protocol_error(_: Request, exc: ProtocolError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(AdapterNotFound)
    async def adapter_not_found(_: Request, exc: AdapterNotFound) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

    @app.exception_handler(RequestFailed)
    async def request_failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return JSONResponse(_error(exc, 500), status_code=500)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await _body(request)
        if body.get("stream"):  # a malformed request raises ProtocolError here, before the stream
            return EventStreamResponse(_sse(native.generate_stream(engine, body, incremental_streaming, version_spans)))
        return JSONResponse(await native.generate(engine, body, version_spans))

    @app.post("/pause_generation")
    async def pause(request: Request) -> JSONResponse:
        mode = (await _body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise ProtocolError("mode must be abort, retract or in_place")
        await engine.pause(mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def resume() -> JSONResponse:
        await engine.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request) -> JSONResponse:
        body = await _body(request)
        if not body.get("model_path"):
            return _fail("model_path is required")
        try:
            label = _label(body, "weight_version")
        except ValueError as exc:
            return _fail(str(exc))
        try:
            seconds = await engine.update_weights(body["model_path"], engine.version if label is None else label,
                                                  bool(body.get("abort_all_requests")))
        except Exception as exc:
            return _fail(f"Failed to update weights: {exc}")
        named = "" if label is None else f" Weight version updated to {label}."
        return _ok(f"Succeeded to update model weights in {seconds:.3f}s.{named}", num_paused_requests=0)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await _body(request)
        try:
            label = _label(body, "new_version")
        except ValueError as exc:
            return _fail(str(exc))
        if label is None:
            return _fail("new_version is required")
        if body.get("abort_all_requests", True):
            await engine.abort(None)
        engine.version = label
        return _ok(f"Weight version updated to {label}", new_version=label)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await _body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        try:
            label = _label(body, "weight_version")
            if not isinstance(path, str) or not path:
                raise AdapterError("lora_path must name an adapter directory")
            if name == served_model_name:
                raise AdapterError(f"{name!r} is the served model's name: requests for the base model would get the adapter")
            if body.get("pinned"):
                raise AdapterError("pinned adapters are not supported by the embedded engine")
            loaded = await engine.load_adapter(name, path, label)
        except ValueError as exc:  # AdapterError, or a label that is not a string
            return _adapters_reply(engine.adapters.loaded(), f"Failed to load LoRA adapter {name}: {exc}")
        return _adapters_reply(loaded)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        name = (await _body(request)).get("lora_name")
        try:
            loaded = await engine.unload_adapter(name)
        except AdapterError as exc:
            return _adapters_reply(engine.adapters.loaded(), str(exc))
        return _adapters_reply(loaded)

    @app.post("/abort_request")
    async def abort(request: Request) -> Response:
        body = await _body(request)
        await engine.abort(None if body.get("abort_all") else body.get("rid"))
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        load = engine.load()
        if load["num_running_reqs"] or load["num_waiting_reqs"]:
            return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.\n")

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        config = engine.model.config
        return {
            "model_path": model_path, "tokenizer_path": model_path, "served_model_name": served_model_name,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": engine.version,
            "load_format": "auto", "model_type": config.model_type, "architectures": config.architectures,
            "context_length": engine.context_length,
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        try:
            await native.generate(engine, {"input_ids": [engine.pad_id], "sampling_params": {"max_new_tokens": 1}})
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        return engine.load()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "model_path": model_path, "served_model_name": served_model_name, "max_running_requests": engine.max_batch_size,
            "context_length": engine.context_length, "incremental_streaming_output": incremental_streaming,
            "weight_version_spans": version_spans, "weight_version": engine.version, "uptime_s": time.time() - started,
            "version": "flywheel-embedded", "internal_states": [engine.load()],
        }

    return app
