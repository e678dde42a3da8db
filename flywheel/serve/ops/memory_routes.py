"""A person's served memory (`memory.enabled`), seen and cleared through the gateway; an operator
clears a tenant's (flywheel/tenants/memory_clear.py).

- `GET /v1/memory` (a client key; the person in `X-User-Id`, none: the tenant's traffic that names
  no user): `{"object": "memory", "enabled", "instructions", "aspects"}`, the instructions the
  served memory puts in their prompts, read from their corrections, and whether it is on for
  them (the deployment's `memory.enabled`, their tenant's `memory`).
- `DELETE /v1/memory` (a client key, `X-User-Id`): their memory cleared, `{"object": "memory",
  "deleted": true}`: their instructions are no longer served (at this gateway from the answer on,
  at the others once they read the audit log), and what was read of their corrections until now
  is not read again, nor remembered by the judge; their records, their consent and their adapter
  stay. The tenant's
  application acts for its people, as it names them on every request; a request that must not
  be remembered at all says `X-Flywheel-Memory: false` (flywheel/serve/api/sessions.py).
- `POST /admin/memory/clear` `{"tenant", "user"?}` (the admin key; 403 where none is
  configured): the same for any tenant's user, or without `user` for all of a tenant's people.

A key reaches its own tenant's people alone: another tenant's person of the same name is
another person, whose memory these routes never see.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request

from flywheel.serve.api.errors import APIError
from flywheel.serve.api.sessions import header_text
from flywheel.serve.api.validation import Body
from flywheel.serve.served_memory import Served, ServedMemory
from flywheel.tenants.memory_clear import clear_memory


class AdminClear(Body):
    """`POST /admin/memory/clear`: a tenant's user, or without `user` all of the tenant's people."""

    tenant: str
    user: str | None = None


def install_memory_routes(app: FastAPI, bus: Any, memory: ServedMemory | None, admin_key: str | None) -> None:
    """The routes above; `memory`: the gateway's (None where it serves none)."""

    async def cleared(tenant: str, user: str | None, actor: str) -> dict[str, Any]:
        if memory is not None:  # here at once; the others when they read the audit entry
            memory.forget(tenant, user, time.time())
        await clear_memory(bus, tenant, user, actor)
        return {"object": "memory", "deleted": True}

    @app.get("/v1/memory")
    async def person_memory(request: Request) -> dict[str, Any]:
        tenant, user = request.state.tenant, header_text(request.headers, "x-user-id") or None
        enabled = memory is not None and tenant not in memory.without
        served = memory.of(tenant, user) if enabled else Served()
        return {"object": "memory", "enabled": enabled, "instructions": list(served.instructions),
                "aspects": list(served.aspects)}

    @app.delete("/v1/memory")
    async def clear_person(request: Request) -> dict[str, Any]:
        tenant, user = request.state.tenant, header_text(request.headers, "x-user-id")
        if not user:
            raise APIError(400, "name the person whose memory to clear in X-User-Id", "X-User-Id", "missing_user")
        return await cleared(tenant, user, f"tenant:{tenant}")

    @app.post("/admin/memory/clear")
    async def admin_clear(body: AdminClear) -> dict[str, Any]:
        if admin_key is None:  # else every caller is the operator (flywheel/serve/ops/auth.py)
            raise APIError(403, "the admin API needs serve.admin_key to be set", code="admin_key_required")
        return await cleared(body.tenant, body.user, "admin")
