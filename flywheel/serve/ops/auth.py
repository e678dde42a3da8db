"""API-key authentication for the gateway: client keys for the OpenAI API, one admin key for control.

`install_auth` adds a pure ASGI middleware. When client keys are configured, every path under
`/v1/` (and `/engine/`, a judge server's scoring route) needs `Authorization: Bearer <one of them>` (or `x-api-key: <one of them>`, as Anthropic's
clients send it). The engine's control routes (SGLang's
`ADMIN_PATHS`: pausing, weight loading, aborts, cache flushes) and the version admin API
(`/admin/...`) need `Bearer <admin_key>` when an admin key is configured. Anything else (`/health`, `/metrics`) is open. A refusal is a 401 in
OpenAI's error shape with `WWW-Authenticate: Bearer`. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from flywheel.serve.api.errors import APIError, anthropic_path

ADMIN_PATHS = frozenset({
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/abort_request",
    "/flush_cache",
    "/update_weight_version",
})
"""SGLang's control routes: whoever reaches them can stall the server or swap its weights."""


def bearer_token(headers: Headers) -> bytes | None:
    """The raw bytes of the token in an `Authorization: Bearer <token>` header, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("latin-1")


def client_key(headers: Headers) -> bytes | None:
    """The key a client sent: a bearer token, else Anthropic's `x-api-key` header."""
    api_key = headers.get("x-api-key", "").strip()
    return bearer_token(headers) or (api_key.encode("latin-1") if api_key else None)


def key_matches(token: bytes | None, keys: list[bytes]) -> bool:
    """Whether `token` is one of `keys`, comparing against every key in constant time each."""
    if token is None:
        return False
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


class AuthMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str], admin_key: str | None):
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.admin_keys = [admin_key.encode()] if admin_key else []

    def _required(self, path: str) -> tuple[list[bytes], str] | None:
        """The keys that may call `path` and what to call them in a refusal; None if it is open."""
        if (path in ADMIN_PATHS or path.startswith("/admin/")) and self.admin_keys:
            return self.admin_keys, "admin key"
        if (path == "/v1" or path.startswith(("/v1/", "/engine/"))) and self.api_keys:
            return self.api_keys, "API key"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        required = self._required(scope["path"]) if scope["type"] == "http" else None
        if required is not None:
            keys, what = required
            headers = Headers(scope=scope)
            token = client_key(headers) if what == "API key" else bearer_token(headers)  # admin: bearer only
            if not key_matches(token, keys):
                reason = f"invalid {what}" if token else f"missing {what}: send 'Authorization: Bearer <key>'"
                error = APIError(401, reason, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response(anthropic_path(scope["path"]))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_auth(app: FastAPI, api_keys: list[str], admin_key: str | None) -> None:
    """Require keys on `app` (see the module docstring); with no keys at all, everything is open."""
    if api_keys or admin_key:
        app.add_middleware(AuthMiddleware, api_keys=list(api_keys), admin_key=admin_key)
