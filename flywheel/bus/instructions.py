"""A person's instructions for replies (`memory.*`): the record the judge keeps on the MEMORY
stream for the gateways (flywheel/judge/instruction_memory.py, flywheel/serve/served_memory.py).

It carries instructions from a fixed list (flywheel/judge/wishes.py, `ASPECTS`) and the aspect
read in each of the person's newest corrections that read one, never their words; a person's
newest record holds all of theirs. It is their tenant's
traffic: kept on the bus no longer than their tenant's records, and deleted by `flywheel forget`
with the rest of theirs (flywheel/tenants/forget.py).

An instruction may show how to greet the person (`GREETING`, the `name` aspect's): SmolLM2-135M
writes a person's name where it is told the name itself far more often than where it is told to
use "the user's name" (docs/experiments/learning-from-use.md). The record keeps the slot, never a
name; where the instruction is served or told, the slot is filled from the conversation it goes
into (`addressed`): the name the person gives there, else the words that ask for one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from string import Template
from typing import Any

from flywheel.bus.messages import content_parts, content_text
from flywheel.bus.records import Record

GREETING = "{greeting}"
"""Where an instruction shows the greeting that opens a reply, filled by `addressed`."""
_NAMED = re.compile(r"\b(?:[Mm]y name is|I['’]m|I am|[Cc]all me|[Tt]his is)\s+([A-Z][a-z]+)\b"
                    r"|\b([A-Z][a-z]+)['’]s (?:\w+ )?assistant\b")


def names_in(messages: list[dict[str, Any]]) -> list[str]:
    """The names the person goes by, in the order the conversation first says them: "my name is
    Maya", "I'm Maya", "call me Maya", a system message's "You are Maya's personal assistant"."""
    said = [" ".join(content_parts(m.get("content"))) for m in messages
            if m.get("role") in ("system", "developer", "user")]
    return list(dict.fromkeys(name for text in said for match in _NAMED.finditer(text) for name in match.groups()
                              if name))


def addressed(text: str, names: Sequence[str]) -> str:
    """`text` with its `GREETING` filled: "Dear Maya," for the first of the person's `names`, or,
    with none known, "Dear" and the user's name."""
    return text.replace(GREETING, f'"Dear {names[0]},"' if names else '"Dear" and the user\'s name')


def said(template: str, instructions: Iterable[str]) -> str:
    """What `memory.placement: system` appends to a system message (`memory.template`)."""
    return Template(template).substitute(instructions=" ".join(instructions))


def placed_before(instructions: Iterable[str]) -> str:
    """What `memory.placement: user` puts before the text of a conversation's first user message."""
    return " ".join(instructions) + "\n\n"


def persons_words(text: str, instructions: Iterable[str]) -> str:
    """The text of a conversation's first user message without what the served memory put before
    it (`Turn.instructions`): the person's own words."""
    instructions = list(instructions)
    return text.removeprefix(placed_before(instructions)) if instructions else text


def without_request(messages: list[dict[str, Any]], instructions: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`messages` with the last user message emptied of the person's words (the conversation before
    it kept, and what the served memory put before them: `instructions`, `Turn.instructions`)."""
    messages = [dict(m) for m in messages]
    users = [m for m in messages if m.get("role") == "user"]
    if users:
        text = content_text(users[-1].get("content"))
        users[-1]["content"] = text[:len(text) - len(persons_words(text, instructions))] if len(users) == 1 else ""
    return messages


def unplaced(messages: list[dict[str, Any]], instructions: Iterable[str], template: str) -> list[dict[str, Any]]:
    """A turn's recorded `messages` as the person sent them: without what the served memory put in
    them (`Turn.instructions`), before the first user message's text (`placement: user`) or at the
    end of the system message in `template` (`placement: system`; a system message of them alone,
    dropped)."""
    instructions = list(instructions)
    messages = [dict(m) for m in messages]
    if not instructions:
        return messages
    before, after = placed_before(instructions), said(template, instructions)
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is not None:
        content = messages[first].get("content")
        if isinstance(content, str) and content.startswith(before):
            messages[first]["content"] = content.removeprefix(before)
            return messages
        if isinstance(content, list) and content and content[0] == {"type": "text", "text": before}:
            messages[first]["content"] = content[1:]
            return messages
    if messages and messages[0].get("role") in ("system", "developer"):
        content = messages[0].get("content")
        if content == after.strip():
            return messages[1:]
        if isinstance(content, str) and content.endswith(after):
            messages[0]["content"] = content.removesuffix(after)
    return messages


class Instructions(Record, kw_only=True):
    tenant: str
    user_id: str | None = None
    """The end user (None: the tenant's traffic that names none, one person)."""
    instructions: list[str]
    """What their newest corrections ask of replies, as instructions to the model."""
    aspects: list[str] = []
    """The aspect each of `instructions` is for (a record from before they were kept: none), which
    the gateway's checks of a reply's form read (`memory.best_of`, flywheel/formats/wish_checks.py)."""
    read: list[str]
    """The aspect read in each of their newest corrections that read one, newest first, which the
    instructions were voted from: a judge that starts again goes on from them."""
    turns: list[str]
    """The turn each of `read` was read in (its interaction id), so that a conversation judged again
    after the judge started again counts once."""
    read_from: float
    """When the oldest conversation they were read from was collected (Unix time, at most): read
    from what was said before a forget or a clear of the memory, they are not taken after it (a
    judge that had not heard of the clear yet may publish a newer conversation's record that still
    holds older corrections)."""
