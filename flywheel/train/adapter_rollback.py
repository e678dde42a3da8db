"""The trainer's side of taking an adapter back to an earlier version
(flywheel/versions/adapter_rollback.py): a request heard on the audit log
(flywheel/train/audit_requests.py), checked, carried out between two steps, and answered there.

It is refused when the trainer has no such adapter (the scope gives that user none, it was
forgotten, or it never trained), when the adapter is a shared or tenant adapter's line under
promotion (the promotion loop's: `flywheel versions rollback --adapter A`), and when the version
asked for is not one the store keeps (nor 0, the adapter's start). Else
`AdapterVersions.roll_back`: the version's weights with fresh optimizer moments, published and
announced as the adapter's next version.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flywheel.bus import Bus
from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.models.adapter_names import is_personal
from flywheel.versions.adapter_rollback import RollbackResult, answer

if TYPE_CHECKING:
    from flywheel.train.loop import TrainLoop

log = logging.getLogger(__name__)


async def roll_back(loop: TrainLoop, bus: Bus, request: AuditEntry) -> None:
    """Carry out (or refuse) `request` (`adapter.rollback`) in `loop`, and answer it."""
    await bus.publish(AUDIT_SUBJECT, answer(request, await carry_out(loop, request)))


async def carry_out(loop: TrainLoop, request: AuditEntry) -> RollbackResult:
    """`request` carried out in `loop`, or refused: the answer's content."""
    name, version, whose = request.details.get("adapter"), request.details.get("version"), request.target
    if not isinstance(name, str) or type(version) is not int:
        return RollbackResult(False, "not a rollback request: it names no adapter and version", found=False)
    if name not in loop.trainer.adapters:
        return RollbackResult(False, f"{whose} has no adapter here (none under the adapters' scope, forgotten, or "
                                     "not trained yet)", found=False)
    if loop.adapter_versions.registry is not None and not is_personal(name):
        return RollbackResult(False, f"{name} is a line under promotion: its rollback is the promotion loop's "
                                     f"(flywheel versions rollback --adapter {name})")
    stored = loop.adapter_versions.store.versions(name)
    if version != 0 and version not in stored:
        kept = ", ".join(f"v{v}" for v in stored) or "none"
        return RollbackResult(False, f"{whose}'s adapter has no v{version} in the store (kept: {kept}; v0 is its start)")
    new = await loop.adapter_versions.roll_back(loop.trainer.adapters, name, version, loop.trainer.step_count)
    log.info("adapter %s back to v%d as v%d, asked by %s", name, version, new, request.actor)
    return RollbackResult(True, f"{whose}'s adapter is v{version}'s weights again, as v{new}", new)
