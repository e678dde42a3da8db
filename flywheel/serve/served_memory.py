"""Each person's instructions, served in their prompts (`memory.enabled`, flywheel/config/memory.py).

The gateway reads the MEMORY stream whole before it serves (each person's newest `Instructions`,
which the judge reads from their corrections: flywheel/judge/instruction_memory.py; after every
forget and clear of the memory on the audit log, so nothing read before one is taken:
flywheel/tenants/memory_clear.py), then follows it, and puts a person's instructions in their chat
requests (Chat Completions, Responses, Messages; a raw completion prompt goes as sent; none where a
request says `X-Flywheel-Memory: false`) before the prompt is built, where `memory.placement` says:
at the end of the system message, or before the text of the conversation's first user message (the
first, so its prompts go on extending one another and what follows each reply, which the judges
read, stays the person's own words): the recorded prompt tokens hold them exactly as the model saw
them, and the person's adapter learns with them. A person is an end user of a tenant; a tenant's
traffic that names no user is one person, as it is one adapter. A session keeps the instructions it
started with (the newest `SESSIONS` sessions are remembered), so its prompts go on extending one
another when the person's memory changes while it is open; an instruction that greets the person is
served with the name its first request gives them (flywheel/bus/instructions.py, `addressed`); with
`memory.opening`, the gateway writes that greeting itself, an opening that names the person
(`memory.opening_text`) starting the conversation's first reply, and the model goes on after it
(`SessionInfo.opening`, the end of the prompt and the start of the answer). Instructions are held no
longer than their record is kept on the bus (their tenant's `retention_days`, else the stream's
age), and at most `PEOPLE` people's (those given theirs least recently dropped first). The stream
keeps each person's newest record only (a subject each), so a gateway's start reads one record a
person, one bus request each.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from flywheel.bus.instructions import GREETING, Instructions, addressed, names_in, placed_before, said
from flywheel.bus.scan import take_all
from flywheel.bus.streams import AUDIT, MEMORY
from flywheel.config import FlywheelConfig
from flywheel.config.tenants import retention_s
from flywheel.lru import LRU
from flywheel.serve.api.chat import ChatCompletionRequest, Message, TextPart
from flywheel.serve.api.sessions import SessionInfo
from flywheel.tenants.forgotten import MEMORY_FORGETTING, Forgettings, forget_of, forgets

SESSIONS = 100_000
PEOPLE = 1_000_000
Person = tuple[str, str | None]


class Served(NamedTuple):
    """A person's instructions as served, the aspect each is for (`Instructions.aspects`), and the
    opening the gateway writes of a conversation's first reply (`memory.opening`)."""

    instructions: tuple[str, ...] = ()
    aspects: tuple[str, ...] = ()
    opening: str = ""


def placed(messages: list[Message], template: str, placement: str, instructions: Iterable[str]) -> list[Message] | None:
    """`messages` with `instructions` where `placement` puts them: in `template` at the end of the
    system message (a system message of them first, where there is none), or alone before the first
    user message's text (`placed_before`; None where there is no user message)."""
    if placement == "user":
        first = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if first is None:
            return None
        return [*messages[:first], _prepended(messages[first], placed_before(instructions)), *messages[first + 1:]]
    text = said(template, instructions)
    if messages and messages[0].role in ("system", "developer"):
        return [messages[0].model_copy(update={"content": messages[0].text() + text}), *messages[1:]]
    return [Message(role="system", content=text.strip()), *messages]


def _prepended(message: Message, text: str) -> Message:
    content = message.content
    return message.model_copy(update={"content": [TextPart(type="text", text=text), *content]
                                      if isinstance(content, list) else text + message.text()})


class ServedMemory:
    def __init__(self, template: str, retention_s: Mapping[str, float] | None = None, people: int = PEOPLE,
                 sessions: int = SESSIONS, without: Iterable[str] = (), placement: str = "system", best_of: int = 1,
                 opening: str = ""):
        self.template = template
        self.opening = opening
        """What opens a named person's first reply in place of the greeting instruction, `{name}` their
        name (`MemoryConfig.opened`); "" where `memory.opening` is off."""
        self.best_of = best_of
        """`memory.best_of`: replies sampled where a person's instructions are served (flywheel/serve/best_of.py)."""
        self.placement = placement
        """`memory.placement`: `system` or `user`."""
        self.without = frozenset(without)
        """Tenants whose people are served no memory (`tenants.NAME.memory: false`)."""
        self.retention_s = dict(retention_s or {})
        """Tenant -> seconds its records are kept (`retention_days`); others: the MEMORY stream's age."""
        self._people: LRU[Person, tuple[Served, float]] = LRU(people)
        """Person -> their instructions and when they expire (Unix time)."""
        self._sessions: LRU[str, tuple[Person, Served]] = LRU(sessions)
        """Session -> whose it is and the instructions it started with."""
        self._forgotten = Forgettings()
        self.taken = 0
        """Records followed, taken or not (the serve loop's stats: `instructions_taken`)."""

    @classmethod
    async def read(cls, bus: Any, config: FlywheelConfig) -> tuple[ServedMemory, int]:
        """The memory `config` asks for (`memory.*`, the tenants' `retention_days` and `memory`),
        read whole from `bus`, before a gateway's first request: every forget and clear so far on
        the audit log, then every record on MEMORY; and the last of those, to follow from."""
        memory = cls(config.memory.template, retention_s(config.tenants), placement=config.memory.placement,
                     without=[name for name, tenant in config.tenants.items() if not tenant.memory],
                     best_of=config.memory.best_of, opening=config.memory.opened)
        await take_all(bus, AUDIT.name, memory.hear)
        return memory, await take_all(bus, MEMORY.name, memory.take)

    def __len__(self) -> int:
        """The people with instructions (the serve loop's stats: `people_remembered`)."""
        return len(self._people)

    def take(self, record: Instructions) -> None:
        """A person's newest instructions, unless read from what they said before they were
        forgotten."""
        self.taken += 1
        person = (record.tenant, record.user_id or None)
        if self._forgotten.since(*person, record.read_from):
            return
        expires = record.created_at + self.retention_s.get(record.tenant, MEMORY.max_age_s)
        self._people[person] = (Served(tuple(sys.intern(text) for text in record.instructions),
                                       tuple(sys.intern(aspect) for aspect in record.aspects)), expires)

    def hear(self, entry: Any) -> None:
        """An entry of the audit log: the people a forget or a clear of the memory covers leave it."""
        if (heard := forget_of(entry, MEMORY_FORGETTING)) is not None:
            self.forget(*heard)

    def forget(self, tenant: str, user: str | None, at: float) -> None:
        """Drop a tenant's people (or one user) and their sessions' instructions; forgotten at
        Unix time `at`. One heard again, or covered by a forget as late or later (a gateway hears
        a forget it made, and each forget begins and ends on the log), drops nothing: what was
        taken since is newer."""
        if self._forgotten.since(tenant, user, at):
            return
        self._forgotten.add(tenant, user, at)
        for person in [person for person in self._people if forgets((tenant, user), person)]:
            self._people.pop(person)
        for session in [s for s in self._sessions if forgets((tenant, user), self._sessions.peek(s)[0])]:
            self._sessions.pop(session)

    def instructions(self, session: SessionInfo, messages: list[Message] = ()) -> Served:
        """What the session's person asked of replies, as of the session's first request here,
        greeting them by the name that request's `messages` give (`addressed`)."""
        person = (session.tenant, session.user_id or None)
        pinned = None if session.anonymous else self._sessions.get(session.session_id)
        if pinned is not None and pinned[0] == person:
            return pinned[1]
        current = self.of(*person)
        if any(GREETING in text for text in current.instructions):
            current = greeted(current, names_in([{"role": m.role, "content": m.text()} for m in messages]), self.opening)
        if not session.anonymous:
            self._sessions[session.session_id] = (person, current)
        return current

    def of(self, tenant: str, user: str | None) -> Served:
        """A person's instructions now (dropped once their record's time is up)."""
        current, expires = self._people.peek((tenant, user)) or (Served(), 0.0)
        if current.instructions and expires <= time.time():
            self._people.pop((tenant, user))
            return Served()
        return current

    def applied(self, body: Any, session: SessionInfo) -> tuple[Any, Served]:
        """A chat request with its person's instructions `placed`, and them (recorded on its turns,
        `Turn.instructions`), with the opening of its reply where that is the conversation's first
        (no assistant message yet) and free text (no tools active, no response format that
        constrains it); any other request (one whose person turned the memory off in it:
        `X-Flywheel-Memory: false`) as it is, and none."""
        if not isinstance(body, ChatCompletionRequest) or session.tenant in self.without or not session.memory:
            return body, Served()
        served = self.instructions(session, body.messages)
        if (any(m.role == "assistant" for m in body.messages) or body.tools and body.tool_choice != "none"
                or body.response_format is not None and body.response_format.constraint() is not None):
            served = served._replace(opening="")
        if not served.instructions:
            return body, served
        if (messages := placed(list(body.messages), self.template, self.placement, served.instructions)) is None:
            return body, Served()
        return body.model_copy(update={"messages": messages}), served


def greeted(served: Served, names: Sequence[str], opening: str) -> Served:
    """`served` greeting the person by the first of their `names`: with an `opening` (`memory.opening`:
    its text, `{name}` the name), a name known and an instruction that greets, that instruction taken
    out and the opening written as the reply's start; else any greeting told (`addressed`)."""
    if not (opening and names and any(GREETING in text for text in served.instructions)):
        return served._replace(instructions=tuple(addressed(text, names) for text in served.instructions))
    kept = [j for j, text in enumerate(served.instructions) if GREETING not in text]
    return Served(tuple(served.instructions[j] for j in kept),
                  tuple(served.aspects[j] for j in kept) if served.aspects else (), opening.format(name=names[0]))
