"""API-key authentication for the gateway: tenants' client keys for the API, one admin key for control.

`install_auth` adds a pure ASGI middleware. When tenants have keys (`TenantDirectory`), every path
under `/v1/` (and `/engine/`, the scoring routes, which the admin key also opens: the judge's
teacher scores with it) needs `Authorization: Bearer <key>`
(or `x-api-key: <key>`, as Anthropic's clients send it), and the request is its key's tenant's:
the middleware puts the tenant's name and the key's `Grant` in the request's state
(`request.state.tenant`, `request.state.grant`; the open tenant's when there are no keys), and
whether it is the operator's (`request.state.operator`: the admin key, or no admin key is
configured; `/engine/` still needs a client key then, when there are any). The engine's control
routes (SGLang's `ADMIN_PATHS`: pausing, weight loading, aborts, cache flushes) and the admin
API (`/admin/...`) need `Bearer <admin_key>` when an admin key is configured; a client key never
reaches them. So do `/metrics` and `/dashboard.json` (`OBSERVED`), which name every tenant, or
`Bearer <metrics_key>` (a scraper's key, which opens nothing else). Anything else (`/health`, the
`/dashboard` page itself) is open. A refusal is a 401 in OpenAI's error shape with `WWW-Authenticate: Bearer`.
The admin key is compared in constant time; client keys are looked up by their SHA-256.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from flywheel.serve.api.errors import APIError, anthropic_path
from flywheel.serve.ops.tenants import TenantDirectory

ADMIN_PATHS = frozenset({
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/abort_request",
    "/flush_cache",
    "/update_weight_version",
    "/load_lora_adapter",
    "/unload_lora_adapter",
})
"""SGLang's control routes: whoever reaches them can stall the server or swap its weights."""
OBSERVED = frozenset({"/metrics", "/dashboard.json"})
"""What an operator watches: every tenant's requests and adapters' versions, by the tenant's name."""


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
    def __init__(self, app: ASGIApp, tenants: TenantDirectory, admin_key: str | None, metrics_key: str | None = None):
        self.app = app
        self.tenants = tenants
        self.admin_keys = [admin_key.encode()] if admin_key else []
        self.metrics_keys = [metrics_key.encode()] if metrics_key else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = Headers(scope=scope)
        operator = not self.admin_keys or key_matches(bearer_token(headers), self.admin_keys)  # bearer only
        scope.setdefault("state", {})["operator"] = operator
        if path in OBSERVED:
            if not operator and not key_matches(bearer_token(headers), self.metrics_keys):
                await self._refuse(scope, receive, send, "admin or metrics key", bearer_token(headers))
                return
        elif path in ADMIN_PATHS or path.startswith("/admin/"):
            if not operator:
                await self._refuse(scope, receive, send, "admin key", bearer_token(headers))
                return
        elif path.startswith("/engine/") and self.admin_keys and operator:  # not without keys: a client key below
            pass  # the operator's own loops score (the judge's teacher on the policy's server), or the gate evaluates
        elif path == "/v1" or path.startswith(("/v1/", "/engine/")):
            token = client_key(headers)
            grant = self.tenants.grant_of(token)
            if grant is None:
                await self._refuse(scope, receive, send, "API key", token)
                return
            scope.setdefault("state", {}).update(tenant=grant.tenant, grant=grant)
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, what: str, token: bytes | None) -> None:
        reason = f"invalid {what}" if token else f"missing {what}: send 'Authorization: Bearer <key>'"
        error = APIError(401, reason, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response(anthropic_path(scope["path"]))(scope, receive, send)


def install_auth(app: FastAPI, tenants: TenantDirectory, admin_key: str | None, metrics_key: str | None = None) -> None:
    """Require keys on `app` (see the module docstring) and say whose each API request is."""
    app.add_middleware(AuthMiddleware, tenants=tenants, admin_key=admin_key, metrics_key=metrics_key)
