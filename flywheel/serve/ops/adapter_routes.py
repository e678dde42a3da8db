"""An end user's own adapter (`adapters.kind: lora`, `adapters.scope: user`), seen and taken back
through the gateway; the trainer carries a rollback out (flywheel/versions/adapter_rollback.py).

- `GET /v1/adapter` (a client key; the end user in `X-User-Id`): the user's own adapter,
  `{"object": "adapter", "versions": [...], "serving": N}`: the versions the store keeps, oldest
  first, and the one this gateway serves them.
- `POST /v1/adapter/rollback` `{"version"?, "reason"?}` (a client key, `X-User-Id`): the user's
  adapter back to `version` (one of `versions`, or 0: its start, the tenant's adapter or the
  base), else to the one before its newest. The tenant's application acts for its users, as it
  names them on every request.
- `POST /admin/adapters/rollback` `{"tenant", "user", "version"?, "reason"?}` (the admin key; 403
  where none is configured): the same for any tenant's user (`flywheel versions rollback [N]
  --tenant T --user U` from a shell).

A rollback answers 200 `{"version", "message"}` (the adapter's new version, which holds the
weights asked for) once the trainer carried it out, 409 when it refused the version (not kept),
504 when no trainer answered in `ROLLBACK_WAIT_S` (the request stays on the audit log: a trainer
that starts carries it out). A user with no adapter of their own (none yet, another scope, a
deployment without adapters) is a 404, as is a user of another tenant: a key reaches its own
tenant's users alone, and what it may not reach answers as what does not exist.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field

from flywheel.models.adapter_names import user_adapter
from flywheel.serve.adapter_loading import AdapterLoading
from flywheel.serve.api.errors import APIError
from flywheel.serve.api.sessions import header_text
from flywheel.serve.api.validation import Body
from flywheel.versions.adapter_rollback import request_rollback

ROLLBACK_WAIT_S = 60.0
"""How long a rollback waits for the trainer's answer."""


class Rollback(Body):
    version: int | None = Field(None, ge=0)
    reason: str = ""


class AdminRollback(Rollback):
    tenant: str
    user: str


def install_adapter_routes(app: FastAPI, bus: Any, adapters: AdapterLoading | None, admin_key: str | None) -> None:
    """The routes above; `adapters`: the gateway's (None where the deployment trains none)."""

    def own_adapter(tenant: str, user: str | None) -> str:
        """`user`'s own adapter's name; 404 unless the store has a version of it."""
        if user is None:
            raise APIError(400, "name the end user whose adapter this is in X-User-Id", "X-User-Id", "missing_user")
        name = user_adapter(tenant, user)
        if adapters is None or not adapters.store.versions(name):
            raise APIError(404, "this user has no adapter of their own", "X-User-Id", "adapter_not_found")
        return name

    async def roll_back(tenant: str, user: str, body: Rollback, actor: str) -> dict[str, Any]:
        assert adapters is not None  # own_adapter checked it
        try:
            result = await request_rollback(bus, adapters.store, tenant, user, body.version, body.reason, actor,
                                            ROLLBACK_WAIT_S)
        except TimeoutError as exc:
            raise APIError(504, str(exc), code="no_trainer") from None
        if not result.ok:
            raise APIError(409 if result.found else 404, result.message, "version", "refused")
        return {"version": result.version, "message": result.message}

    @app.get("/v1/adapter")
    async def adapter(request: Request) -> dict[str, Any]:
        name = own_adapter(request.state.tenant, header_text(request.headers, "x-user-id"))
        assert adapters is not None
        return {"object": "adapter", "versions": adapters.store.versions(name),
                "serving": adapters.pool.adapter_versions.get(name)}

    @app.post("/v1/adapter/rollback")
    async def rollback(body: Rollback, request: Request) -> dict[str, Any]:
        tenant, user = request.state.tenant, header_text(request.headers, "x-user-id")
        own_adapter(tenant, user)
        return await roll_back(tenant, str(user), body, f"tenant:{tenant}")

    @app.post("/admin/adapters/rollback")
    async def admin_rollback(body: AdminRollback) -> dict[str, Any]:
        if admin_key is None:  # else every caller is the operator (flywheel/serve/ops/auth.py)
            raise APIError(403, "the admin API needs serve.admin_key to be set", code="admin_key_required")
        own_adapter(body.tenant, body.user)
        return await roll_back(body.tenant, body.user, body, "admin")
