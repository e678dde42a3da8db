"""Taking an end user's own adapter back to an earlier version (`adapters.kind: lora`,
`adapters.scope: user`): the request an operator puts on the audit log, and the trainer's answer.

A user's own adapter is published to its user as it is made: no gate or canary (those are for
the lines many people share, flywheel/versions/registry.py), only the trainer's guard
(flywheel/train/adapter_guard.py). When a version serves its user worse all the same, an operator
takes it back (`flywheel versions rollback --tenant T --user U [N]`, or `POST
/admin/adapters/rollback`), or the tenant's application for its user (`POST /v1/adapter/rollback`:
flywheel/serve/ops/adapter_routes.py). N is one of the versions
the adapter store keeps (`flywheel versions adapters --tenant T --user U` lists them), or 0: the
adapter's start (its tenant's adapter, else the base). Without N, the version before the newest
(0 when there is none), resolved here from the store, so that the request names a version.

The request is an audit entry (`adapter.rollback`: who asked, whose adapter, to which version,
why), and so is the trainer's answer (`adapter.rolled_back`, with the request's id, whether it was
done and what became of the adapter). The trainer carries it out between two steps
(flywheel/train/adapter_rollback.py): N's weights, with fresh optimizer moments, published again
as a new version above every one the adapter had (an adapter's numbers only grow, so no number
names two weights); every gateway loads that one as it loads any new version, and the adapter
trains on from it. A trainer that is not running carries the request out when it starts, as
it does a forgetting (flywheel/train/audit_requests.py).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT, AUDIT_SUBJECT
from flywheel.models.adapter_names import user_adapter
from flywheel.models.adapter_store import AdapterStore

ROLLBACK = "adapter.rollback"
"""The audit action of an operator's request."""
ROLLED_BACK = "adapter.rolled_back"
"""The audit action of the trainer's answer (`details["request"]`: the request's id)."""


@dataclass
class RollbackResult:
    ok: bool
    message: str
    version: int | None = None
    """The adapter's new version (N's weights), when done."""
    found: bool = True
    """Whether the trainer has the adapter (refused otherwise)."""


def previous_version(store: AdapterStore, name: str) -> int:
    """The version before `name`'s newest in `store` (0, its start, when it has no other)."""
    versions = store.versions(name)
    return versions[-2] if len(versions) > 1 else 0


async def request_rollback(bus: Any, store: AdapterStore, tenant: str, user: str, version: int | None,
                           reason: str = "", operator: str = "cli", timeout_s: float = 60.0) -> RollbackResult:
    """Ask the trainer to take `tenant`'s end user `user`'s adapter back to `version` (None: the
    one before its newest) and wait for its answer; TimeoutError when none came in time."""
    if version is None:
        version = previous_version(store, user_adapter(tenant, user))
    request = AuditEntry(id=uuid.uuid4().hex, actor=operator, action=ROLLBACK, target=f"{tenant}/{user}",
                         details={"tenant": tenant, "user": user, "version": version, "reason": reason})
    before = (await bus.js.stream_info(AUDIT.name)).state.last_seq  # the answer comes after the request
    await bus.publish(AUDIT_SUBJECT, request)
    answers = bus.follow(AUDIT_SUBJECT, after_seq=before)
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                entry = await anext(answers)
                if entry.action == ROLLED_BACK and entry.details.get("request") == request.id:
                    details = entry.details
                    return RollbackResult(details["ok"], details["message"], details.get("version"), details.get("found", True))
    except TimeoutError:
        raise TimeoutError(f"no trainer answered within {timeout_s:.0f} s (the request stays on the audit log: "
                           "a trainer carries it out when it starts)") from None
    finally:
        await answers.aclose()


def answer(request: AuditEntry, result: RollbackResult, adapter: str) -> AuditEntry:
    """The trainer's answer to `request`, on the audit log."""
    return AuditEntry(id=uuid.uuid4().hex, actor="train", action=ROLLED_BACK, target=request.target,
                      details={"request": request.id, "ok": result.ok, "message": result.message, "found": result.found,
                               "adapter": adapter, "version": result.version, "to": request.details.get("version")})
