"""Taking an adapter back to an earlier version where no promotion loop does (`adapters.kind:
lora`): the request an operator puts on the audit log, and the trainer's answer.

An end user's own adapter is published to its user as it is made: no gate or canary, only the
trainer's guard (flywheel/train/adapter_guard.py); and with `promotion.mode: off` so are the
shared and tenant adapters. When a version serves worse all the same, an operator takes it back
(`flywheel versions rollback [N] --tenant T --user U`, or `--adapter A` for a shared or tenant
adapter; `POST /admin/adapters/rollback`), or a tenant's application for its user (`POST
/v1/adapter/rollback`: flywheel/serve/ops/adapter_routes.py). Under promotion a shared or tenant
adapter's line is the promotion loop's (flywheel/versions/registry.py), and the trainer refuses.
N is one of the versions the adapter store keeps (`flywheel versions adapters` lists them), or
0: the adapter's start (a user's: their tenant's adapter, else the base). Without N, the version
before the newest (0 when there is none), resolved here from the store, so that the request
names a version.

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
from flywheel.models.adapter_store import NAME, AdapterStore

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
    """The version before `name`'s newest in `store` (0, its start, when it has no other, or no
    adapter may have its name: the trainer refuses it)."""
    versions = store.versions(name) if NAME.fullmatch(name) else []
    return versions[-2] if len(versions) > 1 else 0


async def request_rollback(bus: Any, store: AdapterStore, adapter: str, target: str, version: int | None,
                           reason: str = "", operator: str = "cli", timeout_s: float = 60.0) -> RollbackResult:
    """Ask the trainer to take `adapter` (`target` on the audit log: `tenant/user` for a user's own)
    back to `version` (None: the one before its newest) and wait for its answer; TimeoutError when
    none came in time."""
    if version is None:
        version = previous_version(store, adapter)
    request = AuditEntry(id=uuid.uuid4().hex, actor=operator, action=ROLLBACK, target=target,
                         details={"adapter": adapter, "version": version, "reason": reason})
    before = await bus.last_seq(AUDIT.name)  # the answer comes after the request
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


def answer(request: AuditEntry, result: RollbackResult) -> AuditEntry:
    """The trainer's answer to `request`, on the audit log."""
    return AuditEntry(id=uuid.uuid4().hex, actor="train", action=ROLLED_BACK, target=request.target,
                      details={"request": request.id, "ok": result.ok, "message": result.message, "found": result.found,
                               "adapter": request.details.get("adapter"), "version": result.version,
                               "to": request.details.get("version")})
