"""What operators ask of the trainer on the audit log (`adapters.kind: lora`): forgetting a tenant or
an end user (`forget`: flywheel/train/forget_adapters.py) and taking an adapter back to an earlier
version (`adapter.rollback`: flywheel/train/adapter_rollback.py).

`AuditRequests.follow` reads the audit log in the background, as every gateway does (the loops
share only the bus); between two steps `apply` carries out what it heard, in the log's order, and
the loop then saves a checkpoint at once, so that a restarted trainer does not carry it out again.

Which entries count: those made after the checkpoint the trainer started from was saved (its
`state.pt`'s time), or after the trainer started when it had none. So a trainer that was stopped
when they were made carries them out once it starts, on the state it restored, and one restarted
from a checkpoint older than some it had carried out carries those out again (a forgetting or a
rollback to a named version comes to the same again).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from flywheel.bus import Bus
from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.train.adapter_rollback import roll_back
from flywheel.train.checkpoint import Checkpoints
from flywheel.train.forget_adapters import forget
from flywheel.versions.adapter_rollback import ROLLBACK

if TYPE_CHECKING:
    from flywheel.train.loop import TrainLoop

ACTIONS = ("forget", ROLLBACK)


class AuditRequests:
    """Requests heard on the audit log, carried out between two steps (see the module docstring)."""

    def __init__(self, bus: Bus, checkpoints: Checkpoints):
        self.bus = bus
        latest = checkpoints.latest()
        self.since = (latest / "state.pt").stat().st_mtime if latest is not None else time.time()
        """Entries made until then are in the trainer's state already (or precede it)."""
        self.pending: list[AuditEntry] = []
        """Requests heard and not yet carried out, in the log's order."""

    async def follow(self) -> None:
        async for entry in self.bus.follow(AUDIT_SUBJECT, from_first=True):
            assert isinstance(entry, AuditEntry)
            if entry.action in ACTIONS and entry.created_at > self.since:
                self.pending.append(entry)
                self.since = entry.created_at  # a follow started again reads the log from its start

    async def apply(self, loop: TrainLoop) -> bool:
        """Carry out in `loop` what was asked since the last call, in order; whether anything was.
        A request stays pending until it is carried out: one that raised is tried again at the next
        step (the loop's step fails meanwhile, as it does while the bus is away)."""
        applied = False
        while self.pending:
            first = self.pending[0]
            if first.action == "forget":  # those in a row together: the checkpoints are rewritten once
                run = list(itertools.takewhile(lambda entry: entry.action == "forget", self.pending))
                await forget(loop, self.bus, [(e.details["tenant"], e.details.get("user")) for e in run])
            else:
                run = [first]
                await roll_back(loop, self.bus, first)
            del self.pending[:len(run)]
            applied = True
        return applied
