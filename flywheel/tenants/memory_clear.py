"""Clearing a person's served memory (`memory.enabled`), short of forgetting them: the instructions
read from their corrections go, their records and adapter stay.

`clear_memory` puts a `memory.clear` entry on the audit log (who asked, whose memory), then erases
their record on MEMORY (for a whole tenant, each of its people's). Every gateway and the judge
follow the log: a gateway drops the person's instructions, their open sessions' too, and takes no
record read from what they said until then (flywheel/serve/served_memory.py); the judge drops what
it remembers of them (flywheel/judge/people_memory.py: the corrections read for their instructions,
the hints its teacher is told on their later replies, the requests practice replays), so the memory
starts again from their next correction. Nothing else of theirs changes: their turns stay recorded
and trainable as they consented, and their adapter keeps what it learned (taking it back is
`/v1/adapter/rollback`). The routes: flywheel/serve/ops/memory_routes.py.
"""

from __future__ import annotations

import uuid
from typing import Any

from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT, MEMORY, memory_subject
from flywheel.tenants.forget import Matcher, delete_matching
from flywheel.tenants.forgotten import CLEARED, target_of


async def clear_memory(bus: Any, tenant: str, user: str | None, actor: str) -> int:
    """Clear the memory of `tenant`'s `user` (None: of all its people, its traffic that names no
    user included, as a forget covers them); the records erased from MEMORY."""
    await bus.publish(AUDIT_SUBJECT, AuditEntry(id=uuid.uuid4().hex, actor=actor, action=CLEARED,
                                                target=target_of(tenant, user),
                                                details={"tenant": tenant, "user": user}))
    if user is None:
        return (await delete_matching(bus, MEMORY.name, Matcher(tenant, None)))[0]
    return int(await bus.erase_last(memory_subject(tenant, user)))
