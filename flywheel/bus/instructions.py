"""A person's instructions for replies (`memory.*`): the record the judge keeps on the MEMORY
stream for the gateways (flywheel/judge/instruction_memory.py, flywheel/serve/served_memory.py).

It carries instructions from a fixed list (flywheel/judge/wishes.py, `ASPECTS`) and the aspect
read in each of the person's newest corrections that read one, never their words; a person's
newest record holds all of theirs. It is their tenant's
traffic: kept on the bus no longer than their tenant's records, and deleted by `flywheel forget`
with the rest of theirs (flywheel/tenants/forget.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from string import Template
from typing import Any

from flywheel.bus.records import Record


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
    read: list[str]
    """The aspect read in each of their newest corrections that read one, newest first, which the
    instructions were voted from: a judge that starts again goes on from them."""
    turns: list[str]
    """The turn each of `read` was read in (its interaction id), so that a conversation judged again
    after the judge started again counts once."""
    read_from: float
    """When the newest conversation they were read from was collected (Unix time): read from
    what was said before a forget, they are not taken after it."""
