"""What the collector keeps of the forgets it reads on the audit log (`flywheel forget`): who was
forgotten (a tenant, or one of its end users) and when, and which sessions it dropped for them.

A forget deletes a person's records from the bus, but the collector may hold some in memory (a
session still open), be sent some late (a turn that was under way, redelivered), or hold a
trajectory it could not publish yet. Each of those, recorded before the forget, would come back.
So a session they took part in is dropped whole, and any record of theirs, or of a dropped
session, that was made before the forget is dropped when it arrives. One made after it is new
traffic, and kept. "Before" compares the record's `created_at` (the gateway's clock) with the
audit entry's (the forgetting process's): clocks apart by more than a forget's duration blur it.
"""

from __future__ import annotations

from collections.abc import Iterable

from flywheel.bus import SessionEvent, Trajectory, Turn
from flywheel.lru import LRU
from flywheel.tenants.forgotten import Forgettings, forgets


class ForgottenPeople:
    def __init__(self, sessions: int):
        self._people = Forgettings()
        """Who was forgotten, and when (Unix time)."""
        self._sessions: LRU[str, float] = LRU(sessions)
        """Sessions dropped for a forget -> when."""

    def add(self, tenant: str, user: str | None, at: float) -> None:
        self._people.add(tenant, user, at)

    def took_part(self, turns: Iterable[Turn], tenant: str, user: str | None, at: float) -> bool:
        """Whether one of `turns`, made by then, is `tenant`'s `user`'s."""
        return any(t.created_at <= at and forgets((tenant, user), (t.tenant, t.user_id)) for t in turns)

    def drop_session(self, session_id: str, at: float) -> None:
        self._sessions[session_id] = at

    def before(self, record: Turn | SessionEvent) -> bool:
        """Whether `record` was made before a forget that covers it: its session's, or its person's."""
        at = self._sessions.peek(record.session_id)
        if at is not None and record.created_at <= at:
            return True
        return isinstance(record, Turn) and self.covers([record])

    def covers(self, turns: Iterable[Turn]) -> bool:
        """Whether a forget covers one of `turns` made before it."""
        return any(self._people.since(turn.tenant, turn.user_id, turn.created_at) for turn in turns)

    def in_trajectory(self, trajectory: Trajectory) -> bool:
        return self.covers(trajectory.turns) or (
            (at := self._sessions.peek(trajectory.session_id)) is not None and trajectory.created_at <= at)
