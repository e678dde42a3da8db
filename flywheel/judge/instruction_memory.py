"""What each person asked of replies, read from their corrections and kept on the bus for the
gateways to serve (`memory.enabled`; flywheel/config/memory.py).

The judge keeps each person's newest corrections (`memory.corrections`: the hints of their turns
judged below zero, as the teacher's memory does) and, after each new one, reads which aspects of
a reply most of them ask to change (`Wish.aspects`, flywheel/judge/wishes.py) and publishes the
instructions for those (`Instructions`), never the words: a correction about anything else
(`other`) or too vague to read adds none, and a person whose kept corrections read none gets an
empty list (the gateways stop serving the old). A person here is an end user of a tenant, whatever
adapter their turns train: the gateways know a request's tenant and user, and the memory is the
person's. Kept and forgotten as flywheel/judge/people_memory.py keeps what the judge remembers.
"""

from __future__ import annotations

from flywheel.bus import Sample, Trajectory
from flywheel.judge.people_memory import PeopleMemory
from flywheel.judge.teacher import hints_of
from flywheel.judge.wishes import ASPECTS, Wish
from flywheel.tenants.instructions import Instructions


class InstructionMemory(PeopleMemory[str]):
    @staticmethod
    def person(trajectory: Trajectory) -> tuple[str, str, str]:
        """(tenant, "", end user): a person's corrections under any adapter are theirs."""
        return trajectory.tenant, "", trajectory.user_id or ""

    def read(self, trajectory: Trajectory, sample: Sample) -> Instructions | None:
        """Keep the corrections of the trajectory's turns the sample judged below zero; the
        person's instructions now, or None when it brought none (or may not be learned from:
        not consented to train, or collected before they were forgotten)."""
        if not trajectory.consent:
            return None
        hints = hints_of(trajectory, sample.details)
        corrections = [hints[k] for k in sorted(hints) if sample.turn_rewards[k] < 0]
        self.keep(trajectory, corrections)
        kept = self.recall(trajectory)
        if not corrections or not kept:
            return None
        return Instructions(id=f"{trajectory.id}#memory", tenant=trajectory.tenant, user_id=trajectory.user_id,
                            instructions=[ASPECTS[aspect] for aspect in Wish(kept, "instead").aspects],
                            read_from=trajectory.created_at)
