"""A served memory of what each person asked of replies (`memory.*`), as chat apps keep one.

The judge reads, in each person's newest corrections, which aspect of a reply they ask to change
(its length, lists or prose, being named, register, ...: flywheel/judge/wishes.py) and keeps the
instruction for it on the bus; the gateways put the person's instructions in their chat requests
(`placement`: the end of the system message, or before the text of a conversation's first user
message), from their next session on. Never their words: only instructions of a
fixed list. On SmolLM2-135M an app's memory of that kind (the instructions read, else the words)
met people's wishes about as often as their trained adapters did, at once
(docs/experiments/learning-from-use.md, where this one is measured too); with adapters, the
adapter learns from the turns served with it. Corrections are read only from turns their person consented to
train on, and the memory is forgotten with them (`flywheel forget`) and kept no longer than
their tenant's records (`tenants.NAME.retention_days`). `flywheel tail memory` prints what is
kept: each record a person's instructions as of one of their corrections.
"""

from __future__ import annotations

from collections.abc import Iterable
from string import Template
from typing import Literal

from pydantic import Field, field_validator

from flywheel.config.section import Section

TEMPLATES = {"system": "\n\nWhat this user has asked of your replies: $instructions", "user": "$instructions\n\n"}
"""Each placement's template."""


class MemoryConfig(Section):
    enabled: bool = False
    """Keep and serve each person's instructions (flywheel/judge/instruction_memory.py,
    flywheel/serve/served_memory.py). Their corrections: the hints of their turns judged below
    zero, feedback text aimed at a reply or what a judge that reads their next message finds in it
    (`judge.kind: next_state`)."""
    corrections: int = Field(5, ge=1, le=32)
    """A person's newest corrections read for their instructions: those most of them ask for
    are served (a person's several corrections point the same way where one is vague)."""
    placement: Literal["system", "user"] = "system"
    """Where a request gets them: `system`, the end of its system message (a request without one
    gets a system message of them); `user`, before the text of its first user message (on
    SmolLM2-135M the base then met people's wishes about half as often again, answering about as
    often: docs/experiments/learning-from-use.md#where-the-instructions-go)."""
    template: str | None = None
    """What they are put in (`string.Template`, $instructions): appended to the system message, or
    prepended to the first user message; None: the placement's own (`TEMPLATES`)."""

    @field_validator("template")
    @classmethod
    def _names_the_instructions(cls, template: str | None) -> str | None:
        if template is not None and "instructions" not in Template(template).get_identifiers():
            raise ValueError("the template must hold $instructions")
        return template

    @property
    def said(self) -> str:
        """The template the gateway uses."""
        return self.template if self.template is not None else TEMPLATES[self.placement]


def said(template: str, instructions: Iterable[str]) -> str:
    """What the served memory adds to a message: `instructions` in `template`."""
    return Template(template).substitute(instructions=" ".join(instructions))
