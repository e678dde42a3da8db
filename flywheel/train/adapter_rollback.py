"""The trainer's side of taking an end user's adapter back to an earlier version
(flywheel/versions/adapter_rollback.py): a request heard on the audit log
(flywheel/train/audit_requests.py), checked, carried out between two steps, and answered there.

It is refused when the trainer has no adapter of that user (the scope gives them none, they
were forgotten, or they never trained) or when the version asked for is not one the store keeps
(nor 0, the adapter's start). Else `AdapterVersions.roll_back`: the version's weights with fresh
optimizer moments, published and announced as the adapter's next version.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flywheel.bus import Bus
from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.models.adapter_names import user_adapter
from flywheel.versions.adapter_rollback import RollbackResult, answer

if TYPE_CHECKING:
    from flywheel.train.loop import TrainLoop

log = logging.getLogger(__name__)


async def roll_back(loop: TrainLoop, bus: Bus, request: AuditEntry) -> None:
    """Carry out (or refuse) `request` (`adapter.rollback`) in `loop`, and answer it."""
    tenant, user, version = (request.details.get(key) for key in ("tenant", "user", "version"))
    if not isinstance(tenant, str) or not isinstance(user, str) or type(version) is not int:
        await bus.publish(AUDIT_SUBJECT, answer(request, RollbackResult(False, "not a rollback request: it needs a "
                                                                        "tenant, a user and a version", found=False), ""))
        return
    name = user_adapter(tenant, user)
    stored = loop.adapter_versions.store.versions(name)
    if name not in loop.trainer.adapters:
        result = RollbackResult(False, f"{tenant}/{user} has no adapter of their own here (none under the tenant's "
                                       "adapters.scope, forgotten, or not trained yet)", found=False)
    elif version != 0 and version not in stored:
        kept = ", ".join(f"v{v}" for v in stored) or "none"
        result = RollbackResult(False, f"{tenant}/{user}'s adapter has no v{version} in the store (kept: {kept}; "
                                       "v0 is its start)")
    else:
        new = await loop.adapter_versions.roll_back(loop.trainer.adapters, name, version, loop.trainer.step_count)
        result = RollbackResult(True, f"{tenant}/{user}'s adapter is v{version}'s weights again, as v{new}", new)
        log.info("adapter %s back to v%d as v%d, asked by %s", name, version, new, request.actor)
    await bus.publish(AUDIT_SUBJECT, answer(request, result, name))
