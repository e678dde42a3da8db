"""The session tracker: groups turns and session events by session and closes sessions into
trajectories.

A session closes when:
- a turn arrives with `session_done` (the client sent `X-Session-Done: true`, or the request had
  no session id and is a one-turn session): reason `done`;
- an `end` event arrives: reason `end`;
- session-level feedback arrives (a reward or text not tied to one turn): reason `feedback`;
  feedback about one turn (`turn_index` set) attaches to the session and does not close it;
- no traffic for `idle_timeout_s`: reason `idle`. A request in flight is traffic: the gateway
  announces each request's turns when it arrives (a `pending` event), and the session stays open
  until they are recorded, however long the reply takes (at most `reply_timeout_s` after the
  announcement, for a gateway that died mid-reply);
- it reaches `max_turns` main turns or `max_tokens` stitched tokens: the turns so far become one
  piece (close reason `limit`) and its later turns the next; the pieces are held until the
  session closes, then emitted together, each with all of the session's feedback (a reward that
  follows must reach every piece; the records stay unacknowledged meanwhile);
- another person's turn arrives (a session two people share: another end user named, or another
  adapter sampled it), also one that joins a session waiting for its reward: likewise a piece
  ends (close reason `user`). A trajectory is one person's: the end user it names, the adapter it
  trains (each turn was sampled with its own user's) and the hints the judge remembers for them
  (`user_splits`). A turn that names no user goes on the stretch it follows.

Feedback and its timing:
- A session ended by `done` or `end` with no session-level reward yet waits `feedback_grace_s`
  for one (clients often post the reward right after the last turn); session feedback ends the
  wait at once. Turns that arrive late for it (a lower turn index than its last) still join.
- A close signal that arrives before any turn (events can overtake turns across gateways) is held
  until the session's first main turn arrives.
- **Late feedback** (for a session already emitted, e.g. after the grace period) is not applied:
  the trajectory may already be judged and trained on, and rewriting history would make rewards
  depend on timing. It is counted (`late_feedback`), logged with the session id, and stays in
  the TRAFFIC stream for replay. Raise `feedback_grace_s` if clients are slower than that.

A trajectory's `turns` keep their text and metadata for the judges but not their token lists:
the tokens are in its `segments` once, where `turn_spans` locate each turn's sampled tokens
(a turn's prompt repeats the whole history; keeping every turn's ids would make a trajectory
grow with the square of its length).

Sessions with only side turns produce nothing. A session's main turns are arranged by lineage
(flywheel/collect/lineage.py): its conversations (a main agent, its sub-agents, helper calls) become
threads with their own segments and next states; retry orphans and turns the client never used
leave it, counted (`retry_orphans`, `unused_turns`, on the trajectory and in `counts`). Records
are deduplicated by id: a repeat of one its session holds (the bus
delivered it again) is kept with the session, to be acknowledged with it, and a repeat of one
already emitted (for the last `remember_closed` sessions) is acknowledged at once.

The tracker is pure bookkeeping: each record comes with an opaque `handle` (the bus delivery),
and every closed session is returned with the handles of everything that went into it, for the
caller to acknowledge once the trajectory is safely published.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from flywheel.bus import SessionEvent, Trajectory, Turn
from flywheel.bus.dedup import RecentIds
from flywheel.bus.stitch import stitch, without_tokens
from flywheel.collect.forgotten_people import ForgottenPeople
from flywheel.collect.lineage import Arrangement, arrange
from flywheel.config.schema import CollectConfig

log = logging.getLogger(__name__)


@dataclass
class _Session:
    session_id: str
    turns: dict[str, Turn] = field(default_factory=dict)
    feedback: list[SessionEvent] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    """Ids of every record (turn or event) that went into the session."""
    close_reason: str | None = None
    last_seen: float = 0.0
    pending: dict[str, float] = field(default_factory=dict)
    """Turns announced but not recorded yet (requests in flight): id -> when to stop waiting."""
    tokens_bound: int = 0
    """Sum of the main turns' prompt + output lengths: an upper bound of the stitched length."""
    pieces: list[tuple[dict[str, Turn], str]] = field(default_factory=list)
    """Turns of earlier pieces of a session cut at a limit or a change of end user (and which),
    held until the session closes."""

    @property
    def has_session_reward(self) -> bool:
        return any(e.reward is not None and e.turn_index is None and e.interaction_id is None for e in self.feedback)

    @property
    def last_turn_index(self) -> int:
        return max(t.turn_index for turns in (*(piece for piece, _ in self.pieces), self.turns) for t in turns.values())

    @property
    def has_turns(self) -> bool:
        return bool(self.turns or self.pieces)

    def all_turns(self) -> list[Turn]:
        return [t for piece, _ in self.pieces for t in piece.values()] + list(self.turns.values())


@dataclass
class Closed:
    """A closed session: its trajectories (one per piece; none if it had no main turn) and the
    handles to acknowledge once all of them are published."""

    trajectories: list[Trajectory]
    handles: list[Any]

    @property
    def trajectory(self) -> Trajectory | None:
        """The session's last trajectory: its only one, unless it was cut (a limit, another person)."""
        return self.trajectories[-1] if self.trajectories else None


def next_state(turn: Turn) -> list[dict[str, Any]]:
    """What a turn's request says happened after the previous assistant turn: the messages after
    its last assistant message (the user's reply, tool results)."""
    messages = turn.messages
    last_assistant = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    return [] if last_assistant is None else list(messages[last_assistant + 1:])


class SessionTracker:
    def __init__(self, config: CollectConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._open: OrderedDict[str, _Session] = OrderedDict()
        """Sessions receiving traffic, least recently active first (idle expiry is O(expired))."""
        self._waiting: OrderedDict[str, tuple[float, _Session]] = OrderedDict()
        """Ended sessions waiting for a reward, with their deadline, earliest first."""
        self._emitted_records = RecentIds(config.remember_closed)
        self._emitted_sessions = RecentIds(config.remember_closed)
        self.forgotten = ForgottenPeople(config.remember_closed)
        """The forgets read on the audit log, and the sessions dropped for them."""
        self.counts = {
            "turns": 0, "duplicates": 0, "side_turns": 0, "events": 0, "trajectories": 0, "empty": 0,
            "splits": 0, "limit": 0, "user_splits": 0, "forgotten_sessions": 0, "forgotten_records": 0,
            "late_feedback": 0, "threads": 0, "retry_orphans": 0, "unused_turns": 0,
            "truncated_turns": 0, "aborted_tokens": 0, "truncated_tokens": 0,
        }
        """`threads`: conversations in the emitted trajectories (a session of one has 1);
        `retry_orphans`, `unused_turns`: turns left out; `truncated_turns`: turns cut at
        max_tokens; `aborted_tokens`, `truncated_tokens`: sampled tokens kept but masked."""

    @property
    def open_sessions(self) -> int:
        return len(self._open) + len(self._waiting)

    def add(self, record: Turn | SessionEvent, handle: Any = None) -> list[Closed]:
        repeat = self._repeat(record, handle)
        if repeat is not None:
            return repeat
        if self.forgotten.before(record):
            self.counts["forgotten_records"] += 1
            return [Closed([], [handle])]
        if isinstance(record, Turn):
            return self._add_turn(record, handle)
        return self._add_event(record, handle)

    def handles(self) -> list[Any]:
        """The handles of every record held in a session not emitted yet."""
        sessions = [*self._open.values(), *(session for _, session in self._waiting.values())]
        return [handle for session in sessions for handle in session.handles]

    def _repeat(self, record: Turn | SessionEvent, handle: Any) -> list[Closed] | None:
        """None for a record not seen before; else what to do with a repeat of it."""
        waiting = self._waiting.get(record.session_id)
        for session in (self._open.get(record.session_id), waiting and waiting[1]):
            if session is not None and record.id in session.seen:
                self.counts["duplicates"] += 1
                session.handles.append(handle)
                return []
        if record.id in self._emitted_records:
            self.counts["duplicates"] += 1
            return [Closed([], [handle])]
        return None

    def expire(self) -> list[Closed]:
        """Emit sessions idle for longer than the timeout and those whose grace period is over."""
        now = self._clock()
        closed = []
        while self._open:
            session = next(iter(self._open.values()))
            if session.last_seen > now - self.config.idle_timeout_s:
                break
            if any(deadline > now for deadline in session.pending.values()):
                self._touch(session.session_id)  # a reply in flight: idle only once it is recorded
                continue
            closed.append(self._emit(self._open.pop(session.session_id), session.close_reason or "idle"))
        while self._waiting:
            deadline, session = next(iter(self._waiting.values()))
            if deadline > now:
                break
            del self._waiting[session.session_id]
            closed.append(self._emit(session, session.close_reason))
        return closed

    def forget(self, tenant: str, user: str | None, at: float) -> list[Closed]:
        """`tenant`'s `user` (every user, for None) forgotten at `at`: the open and waiting sessions
        they took part in by then are dropped whole, nothing of them emitted, their records to be
        acknowledged (the forget deletes them from the bus); what of theirs made before `at` comes
        later is dropped as it arrives (flywheel/collect/forgotten_people.py)."""
        self.forgotten.add(tenant, user, at)
        closed = []
        for sessions, of in ((self._open, lambda held: held), (self._waiting, lambda held: held[1])):
            for sid in [sid for sid, held in sessions.items()
                        if self.forgotten.took_part(of(held).all_turns(), tenant, user, at)]:
                self.forgotten.drop_session(sid, at)
                closed.append(Closed([], of(sessions.pop(sid)).handles))
                self.counts["forgotten_sessions"] += 1
        return closed

    def _touch(self, session_id: str) -> _Session:
        session = self._open.get(session_id)
        if session is None:
            session = self._open[session_id] = _Session(session_id)
        else:
            self._open.move_to_end(session_id)
        session.last_seen = self._clock()
        return session

    def _add_turn(self, turn: Turn, handle: Any) -> list[Closed]:
        waiting = self._waiting.get(turn.session_id)
        if waiting is not None and turn.turn_type == "main" and turn.turn_index <= waiting[1].last_turn_index:
            session = waiting[1]  # a straggler of the ended session
        else:
            session = self._touch(turn.session_id)
        session.handles.append(handle)
        session.seen.add(turn.id)
        session.pending.pop(turn.id, None)
        if turn.turn_type == "side":
            self.counts["side_turns"] += 1
            return []
        self.counts["turns"] += 1
        if session.turns and not _same_person(session.turns.values(), turn):
            self.counts["user_splits"] += 1
            session.pieces.append((session.turns, "user"))
            session.turns, session.tokens_bound = {}, 0
        session.turns[turn.id] = turn
        session.tokens_bound += len(turn.prompt_ids) + len(turn.output_ids)
        if session is not self._open.get(turn.session_id):
            return []
        if turn.session_done:
            session.close_reason = session.close_reason or "done"
        if session.close_reason is None and self._over_limit(session):
            self.counts["limit"] += 1
            session.pieces.append((session.turns, "limit"))
            session.turns, session.tokens_bound = {}, 0
            return []
        return self._end_if_signalled(session)

    def _over_limit(self, session: _Session) -> bool:
        if len(session.turns) >= self.config.max_turns:
            return True
        if session.tokens_bound < self.config.max_tokens:
            return False
        stitched = self._stitch(arrange(list(session.turns.values())), {})
        return sum(len(s.token_ids) for s in stitched) >= self.config.max_tokens

    def _add_event(self, event: SessionEvent, handle: Any) -> list[Closed]:
        self.counts["events"] += 1
        sid = event.session_id
        if event.kind == "pending":
            return self._add_pending(event, handle)
        if sid in self._waiting:
            _, session = self._waiting[sid]
            session.handles.append(handle)
            session.seen.add(event.id)
            if event.kind == "feedback":
                session.feedback.append(event)
                if event.turn_index is None and event.interaction_id is None:
                    del self._waiting[sid]
                    return [self._emit(session, session.close_reason)]
            return []
        if sid not in self._open and sid in self._emitted_sessions:
            if event.kind == "feedback":
                self.counts["late_feedback"] += 1
                log.warning("feedback for session %s arrived after it was emitted; not applied", sid)
            return [Closed([], [handle])]
        session = self._touch(sid)
        session.handles.append(handle)
        session.seen.add(event.id)
        if event.kind == "end":
            session.close_reason = session.close_reason or "end"
        else:
            session.feedback.append(event)
            if event.turn_index is None and event.interaction_id is None:
                session.close_reason = "feedback"
        return self._end_if_signalled(session)

    def _add_pending(self, event: SessionEvent, handle: Any) -> list[Closed]:
        """A request in flight: its session is active (a new one if it had closed) until its
        turns are recorded. Announced turns that were already recorded hold nothing."""
        if event.session_id in self._waiting:  # the session ended; its turns join it as stragglers
            return [Closed([], [handle])]
        session = self._touch(event.session_id)
        session.handles.append(handle)
        session.seen.add(event.id)
        deadline = self._clock() + self.config.reply_timeout_s
        session.pending.update((tid, deadline) for tid in event.turn_ids or () if tid not in session.seen)
        return []

    def _end_if_signalled(self, session: _Session) -> list[Closed]:
        """Close (or start the grace period of) an open session with a close signal and turns."""
        if session.close_reason is None or not session.has_turns:
            return []
        del self._open[session.session_id]
        wait = session.close_reason in ("done", "end") and not session.has_session_reward
        if wait and self.config.feedback_grace_s > 0:
            self._waiting[session.session_id] = (self._clock() + self.config.feedback_grace_s, session)
            return []
        return [self._emit(session, session.close_reason)]

    def _emit(self, session: _Session, reason: str) -> Closed:
        self._emitted_records.add(session.seen)
        pieces = [*session.pieces, *([(session.turns, reason)] if session.turns else [])]
        trajectories = [t for turns, why in pieces if (t := self._trajectory(session, turns, why)) is not None]
        if trajectories:
            self._emitted_sessions.add([session.session_id])
        else:  # no main turn, or none the client used
            self.counts["empty"] += 1
        return Closed(trajectories, session.handles)

    def _trajectory(self, session: _Session, turns: dict[str, Turn], reason: str) -> Trajectory | None:
        """The trajectory of one piece of a session; None when the client used none of its turns."""
        arranged = arrange(list(turns.values()), self.config.truncated_turns)
        for key in ("retry_orphans", "unused_turns", "truncated_turns"):
            self.counts[key] += getattr(arranged, key)
        if not arranged.threads:
            return None
        masked: dict[str, int] = {}
        segments = self._stitch(arranged, masked)
        ordered = [turn for thread in arranged.threads for turn in thread]
        self.counts["trajectories"] += 1
        self.counts["splits"] += len(segments) - len(arranged.threads)
        self.counts["threads"] += len(arranged.threads)
        for why, n in masked.items():
            self.counts[f"{why}_tokens"] += n
        digest = hashlib.sha1("\n".join(sorted(turns)).encode()).hexdigest()[:16]
        return Trajectory(
            id=f"{session.session_id}#{digest}",
            session_id=session.session_id,
            tenant=ordered[0].tenant,
            user_id=next((t.user_id for t in ordered if t.user_id), None),
            adapter=ordered[-1].adapter,
            consent=all(t.consent for t in ordered),
            task_id=next((t.task_id for t in ordered if t.task_id), None),
            group_size=next((t.group_size for t in ordered if t.group_size), None),
            segments=segments,
            turns=[without_tokens(t) for t in ordered],
            threads=[n for n, thread in enumerate(arranged.threads) for _ in thread],
            next_states=[state for thread in arranged.threads for state in _next_states(thread)],
            feedback=session.feedback,
            close_reason=reason,
            retry_orphans=arranged.retry_orphans,
            unused_turns=arranged.unused_turns,
            masked_tokens=masked,
        )

    @staticmethod
    def _stitch(arranged: Arrangement, masked: dict[str, int]) -> list:
        """Each thread's segments in turn; spans name turns by their place in the trajectory."""
        segments, position = [], 0
        for thread in arranged.threads:
            segments += stitch(thread, position, arranged.untrained, masked)
            position += len(thread)
        return segments


def _same_person(turns: Iterable[Turn], turn: Turn) -> bool:
    """Whether `turn` goes on the same person's stretch as `turns`: sampled with the same adapter,
    and naming the same end user where both name one (a client that names its user on some
    requests only is still one person)."""
    turns = list(turns)
    user = next((t.user_id for t in turns if t.user_id), None)
    return turns[-1].adapter == turn.adapter and (user is None or turn.user_id is None or user == turn.user_id)


def _next_states(thread: list[Turn]) -> list[list[dict[str, Any]]]:
    """What followed each turn of a conversation: the next turn's request after its last
    assistant message (nothing after the last)."""
    return [next_state(t) for t in thread[1:]] + [[]]

