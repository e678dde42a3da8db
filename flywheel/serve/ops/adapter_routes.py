"""An end user's own adapter (`adapters.kind: lora`, `adapters.scope: user`), seen and taken back
through the gateway, and a tenant's adapter by an operator; the trainer carries a rollback out
(flywheel/versions/adapter_rollback.py).

- `GET /v1/adapter` (a client key; the end user in `X-User-Id`): the user's own adapter,
  `{"object": "adapter", "versions": [...], "serving": N}`: the versions the store keeps, oldest
  first, and the one this gateway serves them.
- `POST /v1/adapter/rollback` `{"version"?, "reason"?}` (a client key, `X-User-Id`): the user's
  adapter back to `version` (one of `versions`, or 0: its start, the tenant's adapter or the
  base), else to the one before its newest. The tenant's application acts for its users, as it
  names them on every request.
- `POST /admin/adapters/rollback` `{"tenant", "user"?, "version"?, "reason"?}` (the admin key; 403
  where none is configured): the same for any tenant's user, or without `user` for the tenant's
  own adapter where no promotion loop has its line (`flywheel versions rollback [N] --tenant T
  --user U`, `--adapter T`, from a shell).

A rollback answers 200 `{"version", "message"}` (the adapter's new version, which holds the
weights asked for) once the trainer carried it out, 409 when it refused (a version not kept, a
line under promotion), 504 when no trainer answered in `ROLLBACK_WAIT_S` (the request stays on
the audit log: a trainer that starts carries it out). A user with no adapter of their own (none yet, another scope, a
deployment without adapters) is a 404, as is a user of another tenant: a key reaches its own
tenant's users alone, and what it may not reach answers as what does not exist.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import Field

from flywheel.models.adapter_names import user_adapter
from flywheel.models.adapter_store import NAME
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
    user: str | None = None


def install_adapter_routes(app: FastAPI, bus: Any, adapters: AdapterLoading | None, admin_key: str | None) -> None:
    """The routes above; `adapters`: the gateway's (None where the deployment trains none)."""

    def stored(name: str, param: str) -> str:
        """`name`; 404 unless the store has a version of it (a name no adapter may have included)."""
        if adapters is None or not NAME.fullmatch(name) or not adapters.store.versions(name):
            raise APIError(404, "no such adapter: this user has none of their own" if "." in name else
                           f"no such adapter: {name!r}", param, "adapter_not_found")
        return name

    def own_adapter(tenant: str, user: str | None) -> str:
        """`user`'s own adapter's name (404 unless stored)."""
        if user is None:
            raise APIError(400, "name the end user whose adapter this is in X-User-Id", "X-User-Id", "missing_user")
        return stored(user_adapter(tenant, user), "X-User-Id")

    async def roll_back(name: str, target: str, body: Rollback, actor: str) -> dict[str, Any]:
        assert adapters is not None  # `stored` checked it
        try:
            result = await request_rollback(bus, adapters.store, name, target, body.version, body.reason, actor,
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
        return await roll_back(own_adapter(tenant, user), f"{tenant}/{user}", body, f"tenant:{tenant}")

    @app.post("/admin/adapters/rollback")
    async def admin_rollback(body: AdminRollback) -> dict[str, Any]:
        if admin_key is None:  # else every caller is the operator (flywheel/serve/ops/auth.py)
            raise APIError(403, "the admin API needs serve.admin_key to be set", code="admin_key_required")
        if body.user is None:  # the tenant's own adapter
            return await roll_back(stored(body.tenant, "tenant"), body.tenant, body, "admin")
        return await roll_back(stored(user_adapter(body.tenant, body.user), "user"), f"{body.tenant}/{body.user}",
                               body, "admin")
