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
train on and did not keep out of the memory (`X-Flywheel-Memory: false`); the memory is forgotten
with them (`flywheel forget`), cleared on their or an operator's request (`DELETE /v1/memory`,
flywheel/tenants/memory_clear.py) and kept no longer than their tenant's records
(`tenants.NAME.retention_days`). `flywheel tail memory` prints what is
kept: each record a person's instructions as of one of their corrections.
"""

from __future__ import annotations

from string import Template
from typing import Literal

from pydantic import Field, field_validator, model_validator

from flywheel.config.section import Section

TEMPLATE = "\n\nWhat this user has asked of your replies: $instructions"


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
    """Where a request gets them: `system`, in `template` at the end of its system message (a
    request without one gets a system message of them); `user`, the instructions alone and a blank
    line before the text of its first user message, which the judge can take off again to read the
    person's words (flywheel/bus/instructions.py). On SmolLM2-135M the base met people's wishes
    about half as often again before the question, and more people learned within 15
    conversations, but new questions were answered less often by the bench's rule (0.77 against
    0.90): hence the default (docs/experiments/learning-from-use.md#where-the-instructions-go-memoryplacement)."""
    best_of: int = Field(1, ge=1, le=8)
    """Replies sampled for a whole (not streamed) chat answer of one choice, no tools, that the
    served memory put a person's instructions in: of those that answer the question (the engine
    read with no adapter: with adapters, the frozen base the judge's teacher reads with), the one
    the checks of the instructions rank first where a rule checks them (a reply's length, lists or
    prose, register, being named: flywheel/formats/wish_checks.py; for a shorter reply, the most
    said per character; ties, the one that says the most), else the first of them, is served and
    recorded. 1: one reply, as sampled. On SmolLM2-135M with the instructions before the question,
    2 raised the share of first replies meeting the wish from about half to 0.77 offline, and of
    adapters' held-out replies answering (the bench's rule) from 0.72 to 0.86
    (flywheel/serve/best_of.py; docs/experiments/learning-from-use.md). It costs k decodes at once
    and two prefills a reply; streams and other requests are served one reply. Not with `serve.engine_kind: vllm` (its
    client does not score)."""
    opening: bool = False
    """Where a person asked to be named (the `name` aspect) and the conversation gives their name,
    the gateway writes the opening of the conversation's first reply itself (`opening_text`) and
    the model goes on after it, in place of the instruction to greet them
    (flywheel/serve/served_memory.py; not where the answer is not free text: tools active, a
    response format that constrains it). Told to open with the name, SmolLM2-135M writes a letter
    that both names and answers 0.16 of the time (a blind reader); after "Maya," 0.42, after
    "Good question, Maya." 0.54 (untold it answers 0.51 and names 0.07). The bench's three people
    who asked for their name learned at 4, 7 and 9 with "Maya," (and >15, 4, 9), and at 4, 7 and 7
    with "Good question, Maya." (and >15, 4, 5), whose held-out replies answered 0.40 -> 0.35 over five trials
    (blind readers; after "Maya," 0.39 -> 0.25)
    (docs/experiments/learning-from-use.md#a-served-opening-memoryopening)."""
    opening_text: str = "Good question, {name}."
    """The opening `opening` writes, `{name}` the person's name (no other braces): of four measured,
    the one after which the base answered most (blind readers; "{name}," 0.42, "Sure, {name}!"
    0.49, this 0.54)."""
    template: str = TEMPLATE
    """What `placement: system` appends to the system message (`string.Template`, $instructions);
    a request without one gets a system message of it, stripped."""

    @field_validator("template")
    @classmethod
    def _names_the_instructions(cls, template: str) -> str:
        if "instructions" not in Template(template).get_identifiers():
            raise ValueError("the template must hold $instructions")
        return template

    @field_validator("opening_text")
    @classmethod
    def _names_the_person(cls, text: str) -> str:
        try:
            text.format(name="")
        except (KeyError, IndexError, ValueError):
            text = ""
        if "{name}" not in text:
            raise ValueError("the opening must hold {name} and no other braces")
        return text

    @property
    def opened(self) -> str:
        """The opening written where a person asked to be named: `opening_text`, or "" (`opening` off)."""
        return self.opening_text if self.opening else ""

    @model_validator(mode="after")
    def _template_only_in_the_system_message(self) -> "MemoryConfig":
        if self.placement == "user" and self.template != TEMPLATE:
            raise ValueError("memory.template is what placement: system appends to the system message; "
                             "placement: user puts the instructions alone before the person's words")
        return self
