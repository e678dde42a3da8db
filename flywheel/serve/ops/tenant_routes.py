"""The tenants, changed at run time through the admin API (admin key), with no restart.

- `GET /admin/tenants`: every tenant, its consent settings and its keys (by id, never the key).
- `POST /admin/tenants` `{"name", "training"?, "store"?}`: a new tenant (409 if it exists).
- `PATCH /admin/tenants/{name}` `{"training"?, "store"?}`: change a tenant's settings.
- `POST /admin/tenants/{name}/keys` `{"training"?, "store"?}`: a new key, answered once
  (`{"id", "key"}`): only its SHA-256 is kept.
- `DELETE /admin/tenants/{name}/keys/{id}`: revoke a key (one of the configuration's too).
- `POST /admin/forget` `{"tenant", "user"?}`: remove their records (`flywheel/tenants/forget.py`,
  as `flywheel forget` does) and answer what went and which versions learned from them.
- `GET /admin/audit`: the audit log, newest last.

Every change is written to the bus (`TenantRegistry`), which every gateway follows, and appended
to the audit log. These routes need the admin key and answer 403 where none is configured:
whoever could reach them could mint keys for any tenant.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI

from flywheel.bus.records import AuditEntry
from flywheel.config.tenants import tenant_name_error
from flywheel.serve.api.errors import APIError
from flywheel.serve.api.validation import Body
from flywheel.serve.ops.tenants import TenantDirectory
from flywheel.tenants.forget import forget
from flywheel.tenants.records import KeyEntry, TenantEntry
from flywheel.tenants.registry import Changed, TenantRegistry

Training = Literal["opt_in", "opt_out", "off"]
PiiPolicy = Literal["off", "drop", "redact_input"]


class NewTenant(Body):
    name: str
    training: Training = "opt_in"
    store: bool = True
    pii: PiiPolicy = "drop"


class TenantChange(Body):
    training: Training | None = None
    store: bool | None = None
    pii: PiiPolicy | None = None


class Forget(Body):
    tenant: str
    user: str | None = None


class NewKey(Body):
    training: Training | None = None
    store: bool = True


def install_tenant_routes(app: FastAPI, directory: TenantDirectory, registry: TenantRegistry,
                          admin_key: str | None, spill_dirs: list[Path], ledger: Path) -> None:
    def admin() -> None:
        """Refuse every call where no admin key guards these routes (the middleware checks the key)."""
        if admin_key is None:
            raise APIError(403, "the tenant admin API needs serve.admin_key to be set", code="admin_key_required")

    async def entry_of(name: str) -> tuple[TenantEntry, int]:
        """The tenant's run-time entry, started from the configuration's settings, and the revision
        it was read at (0: none yet); 404 if no such tenant."""
        entry, revision = await registry.read(name)
        if entry is not None and (entry.forgotten_at is None or directory.configured(name)):
            return entry, revision  # a forgotten tenant of the configuration keeps its changed settings
        known = directory.tenants().get(name) if entry is None else None
        if known is None:  # also a forgotten tenant made at run time: as if never made
            raise APIError(404, f"tenant {name!r} not found", "name", "tenant_not_found")
        return TenantEntry(name=name, training=known["training"], store=known["store"], pii=known["pii"]), revision

    async def save(entry: TenantEntry, revision: int, action: str, target: str, details: dict[str, Any]) -> None:
        """Write `entry` over the one read at `revision`: 409 if it changed meanwhile (another admin
        call, or a forget that revoked its keys), for the caller to send again."""
        try:
            await registry.write(entry, revision)
        except Changed:
            raise APIError(409, f"tenant {entry.name!r} changed meanwhile; send it again", "name",
                           "tenant_changed") from None
        directory.apply(entry)
        await registry.audit(AuditEntry(id=secrets.token_hex(16), actor="admin", action=action, target=target,
                                        details=details))

    @app.get("/admin/tenants")
    async def tenants() -> dict[str, Any]:
        admin()
        return {"object": "list", "data": [{"name": name, **about} for name, about in sorted(directory.tenants().items())]}

    @app.post("/admin/tenants")
    async def add_tenant(body: NewTenant) -> dict[str, Any]:
        admin()
        if (error := tenant_name_error(body.name)) is not None:
            raise APIError(400, error, "name")
        before, revision = await registry.read(body.name)
        if body.name in directory.tenants() or directory.configured(body.name) \
                or (before is not None and before.forgotten_at is None):
            raise APIError(409, f"tenant {body.name!r} exists", "name", "tenant_exists")
        entry = TenantEntry(name=body.name, training=body.training, store=body.store, pii=body.pii,
                            keys=before.keys if before is not None else [])  # a forgotten one's: revoked
        await save(entry, revision, "tenant.add", body.name,
                   {"training": body.training, "store": body.store, "pii": body.pii})
        return {"name": entry.name, "training": entry.training, "store": entry.store, "pii": entry.pii, "keys": []}

    @app.patch("/admin/tenants/{name}")
    async def change_tenant(name: str, body: TenantChange) -> dict[str, Any]:
        admin()
        entry, revision = await entry_of(name)
        changed = body.model_dump(exclude_none=True)
        for field, value in changed.items():
            setattr(entry, field, value)
        await save(entry, revision, "tenant.change", name, changed)
        return {"name": name, "training": entry.training, "store": entry.store, "pii": entry.pii}

    @app.post("/admin/tenants/{name}/keys")
    async def add_key(name: str, body: NewKey | None = None) -> dict[str, Any]:
        admin()
        body = body or NewKey()
        entry, revision = await entry_of(name)
        key = "fw-" + secrets.token_urlsafe(32)
        digest = hashlib.sha256(key.encode()).hexdigest()
        entry.keys.append(KeyEntry(id=digest[:12], digest=digest, training=body.training, store=body.store))
        await save(entry, revision, "key.add", f"{name}/{digest[:12]}",
                   {"training": body.training, "store": body.store})
        return {"id": digest[:12], "key": key, "tenant": name}

    @app.delete("/admin/tenants/{name}/keys/{key_id}")
    async def revoke_key(name: str, key_id: str) -> dict[str, Any]:
        admin()
        entry, revision = await entry_of(name)
        digest = next((d for d, grant in directory.grants.items() if grant.tenant == name and d.hex()[:12] == key_id), None)
        if digest is None:
            raise APIError(404, f"tenant {name!r} has no key {key_id!r}", "key_id", "key_not_found")
        entry.keys = [k for k in entry.keys if k.digest != digest.hex()]
        entry.keys.append(KeyEntry(id=key_id, digest=digest.hex(), revoked=True))
        await save(entry, revision, "key.revoke", f"{name}/{key_id}", {})
        return {"id": key_id, "tenant": name, "revoked": True}

    @app.post("/admin/forget")
    async def forget_them(body: Forget) -> dict[str, Any]:
        admin()
        app.state.forget_cached(body.tenant, body.user)  # first: a request of theirs ending meanwhile is not recorded
        report = await forget(registry.bus, body.tenant, body.user, spill_dirs, ledger, actor="admin")
        if body.user is None and (entry := await registry.get(body.tenant)) is not None:
            directory.apply(entry)  # here at once (the watcher may be a moment behind)
        return report.as_dict()

    @app.get("/admin/audit")
    async def audit() -> dict[str, Any]:
        admin()
        return {"object": "list", "data": [_plain(entry) for entry in await registry.audit_log()]}


def _plain(entry: AuditEntry) -> dict[str, Any]:
    return {"at": entry.created_at, "actor": entry.actor, "action": entry.action, "target": entry.target,
            "details": entry.details}
