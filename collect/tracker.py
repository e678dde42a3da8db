"""The session tracker: groups turns and session events by session and closes sessions into
trajectories.

A session closes when:
- a turn arrives with `session_done` (the client sent `X-Session-Done: true`, or the request had
  no session id and is a one-turn session): reason `done`;
- an `end` event arrives: reason `end`;
- session-level feedback arrives (a reward or text not tied to one turn): reason `feedback`;
  feedback about one turn (`turn_index` set) attaches to the session and does not close it;
- no traffic for `idle_timeout_s`: reason `idle`.
A close signal that arrives before any turn (events can overtake turns across gateways) is held
until the session's first main turn arrives. Sessions with only side turns produce nothing.

The tracker is pure bookkeeping: each record comes with an opaque `handle` (the bus delivery),
and every closed session is returned with the handles of everything that went into it, for the
caller to acknowledge once the trajectory is safely published. Turns are deduplicated by id.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bus import SessionEvent, Trajectory, Turn
from collect.stitch import stitch


@dataclass
class _Session:
    turns: dict[str, Turn] = field(default_factory=dict)
    feedback: list[SessionEvent] = field(default_factory=list)
    close_reason: str | None = None
    last_seen: float = 0.0
    handles: list[Any] = field(default_factory=list)


@dataclass
class Closed:
    """A closed session: its trajectory (None if it had no main turn) and handles to ack."""

    trajectory: Trajectory | None
    handles: list[Any]


class SessionTracker:
    def __init__(self, idle_timeout_s: float, clock: Callable[[], float] = time.monotonic, remember: int = 100_000):
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._emitted: OrderedDict[str, None] = OrderedDict()
        self._remember = remember
        self.counts = {"turns": 0, "duplicates": 0, "side_turns": 0, "events": 0, "trajectories": 0, "empty": 0}

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    def add(self, record: Turn | SessionEvent, handle: Any = None) -> list[Closed]:
        if isinstance(record, Turn):
            return self._add_turn(record, handle)
        return self._add_event(record, handle)

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.setdefault(session_id, _Session())
        session.last_seen = self._clock()
        return session

    def _add_turn(self, turn: Turn, handle: Any) -> list[Closed]:
        existing = self._sessions.get(turn.session_id)
        if turn.id in self._emitted or (existing is not None and turn.id in existing.turns):
            self.counts["duplicates"] += 1
            return [Closed(None, [handle])]
        session = self._session(turn.session_id)
        session.handles.append(handle)
        if turn.turn_type == "side":
            self.counts["side_turns"] += 1
        else:
            self.counts["turns"] += 1
            session.turns[turn.id] = turn
        if turn.session_done:
            session.close_reason = session.close_reason or "done"
        return self._close_if_ready(turn.session_id)

    def _add_event(self, event: SessionEvent, handle: Any) -> list[Closed]:
        self.counts["events"] += 1
        session = self._session(event.session_id)
        session.handles.append(handle)
        if event.kind == "end":
            session.close_reason = session.close_reason or "end"
        else:
            session.feedback.append(event)
            if event.turn_index is None:
                session.close_reason = session.close_reason or "feedback"
        return self._close_if_ready(event.session_id)

    def _close_if_ready(self, session_id: str) -> list[Closed]:
        session = self._sessions[session_id]
        if session.close_reason is None or not session.turns:
            return []
        return [self._close(session_id, session.close_reason)]

    def expire(self) -> list[Closed]:
        """Close sessions idle for longer than the timeout."""
        cutoff = self._clock() - self.idle_timeout_s
        idle = [sid for sid, s in self._sessions.items() if s.last_seen <= cutoff]
        return [self._close(sid, "idle") for sid in idle]

    def _close(self, session_id: str, reason: str) -> Closed:
        session = self._sessions.pop(session_id)
        if not session.turns:
            self.counts["empty"] += 1
            return Closed(None, session.handles)
        turns = sorted(session.turns.values(), key=lambda t: (t.turn_index, t.created_at))
        for turn in turns:
            self._emitted[turn.id] = None
        while len(self._emitted) > self._remember:
            self._emitted.popitem(last=False)
        self.counts["trajectories"] += 1
        digest = hashlib.sha1("\n".join(sorted(session.turns)).encode()).hexdigest()[:16]
        trajectory = Trajectory(
            id=f"{session_id}#{digest}",
            session_id=session_id,
            task_id=next((t.task_id for t in turns if t.task_id), None),
            segments=stitch(turns),
            turns=turns,
            feedback=session.feedback,
            close_reason=reason,
        )
        return Closed(trajectory, session.handles)
