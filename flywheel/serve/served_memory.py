"""Each person's instructions, served in their prompts (`memory.enabled`, flywheel/config/memory.py).

The gateway follows the MEMORY stream from its start (each person's newest `Instructions`, which
the judge reads from their corrections: flywheel/judge/instruction_memory.py) and puts a
person's instructions in the system message of their chat requests (Chat Completions, Responses,
Messages; a raw completion prompt has no system message and goes as sent) before the prompt is
built: the recorded prompt tokens hold them exactly as the model saw them, and the person's
adapter learns with them. A session keeps the instructions it started with (the newest
`SESSIONS` sessions are remembered), so its prompts go on extending one another when the
person's memory changes while it is open. A forgotten tenant or user is dropped at once (the
audit log), and instructions read from what they said before the forget are not taken after it.
Held in the gateway's memory: a few references a person, to the instructions' shared strings.
"""

from __future__ import annotations

import sys
from string import Template
from typing import Any

from flywheel.lru import LRU
from flywheel.serve.api.chat import ChatCompletionRequest, Message
from flywheel.serve.api.sessions import SessionInfo
from flywheel.tenants.forgotten import Forgettings, forgets
from flywheel.tenants.instructions import Instructions

SESSIONS = 100_000
Person = tuple[str, str | None]


class ServedMemory:
    def __init__(self, template: str, sessions: int = SESSIONS):
        self.template = Template(template)
        self._people: dict[Person, tuple[str, ...]] = {}
        self._sessions: LRU[str, tuple[Person, tuple[str, ...]]] = LRU(sessions)
        """Session -> whose it is and the instructions it started with."""
        self._forgotten = Forgettings()
        self.taken = 0
        """Records followed, taken or not (the serve loop's stats: `instructions_taken`)."""

    def __len__(self) -> int:
        """The people with instructions (the serve loop's stats: `people_remembered`)."""
        return len(self._people)

    def take(self, record: Instructions) -> None:
        """A person's newest instructions (none: they have none any more), unless read before
        they were forgotten."""
        self.taken += 1
        person = (record.tenant, record.user_id)
        if self._forgotten.since(*person, record.read_from):
            return
        if record.instructions:
            self._people[person] = tuple(sys.intern(text) for text in record.instructions)
        else:
            self._people.pop(person, None)

    def forget(self, tenant: str, user: str | None, at: float) -> None:
        """Drop a tenant's people (or one user) and their sessions' instructions; forgotten at
        Unix time `at`."""
        self._forgotten.add(tenant, user, at)
        for person in [person for person in self._people if forgets((tenant, user), person)]:
            del self._people[person]
        for session in [s for s in self._sessions if forgets((tenant, user), self._sessions.peek(s)[0])]:
            self._sessions.pop(session)

    def instructions(self, session: SessionInfo) -> tuple[str, ...]:
        """What the session's person asked of replies, as of the session's first request here."""
        person = (session.tenant, session.user_id)
        pinned = None if session.anonymous else self._sessions.get(session.session_id)
        if pinned is not None and pinned[0] == person:
            return pinned[1]
        current = self._people.get(person, ())
        if not session.anonymous:
            self._sessions[session.session_id] = (person, current)
        return current

    def applied(self, body: Any, session: SessionInfo) -> Any:
        """A chat request with its person's instructions at the end of its system message (a
        system message of them first, where it has none); any other request as it is."""
        if not isinstance(body, ChatCompletionRequest) or not (instructions := self.instructions(session)):
            return body
        said = self.template.substitute(instructions=" ".join(instructions))
        messages = list(body.messages)
        if messages and messages[0].role in ("system", "developer"):
            messages[0] = messages[0].model_copy(update={"content": messages[0].text() + said})
        else:
            messages.insert(0, Message(role="system", content=said.strip()))
        return body.model_copy(update={"messages": messages})
