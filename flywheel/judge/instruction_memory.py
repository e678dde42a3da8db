"""What each person asked of replies, read from their corrections and kept on the bus for the
gateways to serve (`memory.enabled`; flywheel/config/memory.py).

For each new correction of a person (the hint of a turn of theirs judged below zero, as the
teacher's memory takes them) the judge reads which aspect of a reply it asks to change
(`WishReader.aspect`, flywheel/judge/wishes.py) and keeps that label, never the words, for their
newest `memory.corrections` that read one (a correction about anything else, or too vague to
read, neither votes nor pushes out what they asked before); then it publishes the instructions
for the aspects most of those ask for (`Instructions`), of two opposite ones asked as often
(shorter and longer, lists and prose, formal and casual) the one asked last, and none for an
aspect whose instruction cost answers and gained nothing measured (`UNSERVED`: the teacher is
still told it). The labels, and
the turns they were read in, travel in the record, so a judge that starts again reads each
person's newest record first (`restore`) and goes on from it, a conversation judged again
counting once. A person here is an end user of a tenant, whatever adapter their turns train:
the gateways know a request's tenant and user, and the memory is the person's. Kept and
forgotten as flywheel/judge/people_memory.py keeps what the judge remembers.
"""

from __future__ import annotations

from flywheel.bus import Sample, Trajectory
from flywheel.bus.instructions import Instructions
from flywheel.judge.people_memory import PeopleMemory
from flywheel.judge.teacher import hints_of
from flywheel.judge.wishes import ASPECTS, OPPOSITES, UNSERVED, most_asked, wish_reader

Read = tuple[str, str]
"""(the correction's turn id, the aspect read in it): a conversation judged again counts once."""


class InstructionMemory(PeopleMemory[Read]):
    def __init__(self, size: int):
        super().__init__(size, key=lambda read: read[0])

    @staticmethod
    def person(trajectory: Trajectory) -> tuple[str, str, str]:
        """(tenant, "", end user): a person's corrections under any adapter are theirs."""
        return trajectory.tenant, "", trajectory.user_id or ""

    def read(self, trajectory: Trajectory, sample: Sample) -> Instructions | None:
        """Keep what the corrections of the trajectory's turns the sample judged below zero ask
        for; the person's instructions now, or None when it brought none, or may not be learned
        from (not consented to train, kept out of the memory, or collected before its person was
        forgotten or their memory cleared)."""
        person = self.person(trajectory)
        if not trajectory.consent or self.kept_out(trajectory) or self.forgotten_since(person, trajectory.created_at):
            return None
        hints = hints_of(trajectory, sample.details)
        reader = wish_reader()
        aspects = [(trajectory.turns[k].id, reader.aspect(hints[k])) for k in sorted(hints) if sample.turn_rewards[k] < 0]
        if not (read := [(turn, aspect) for turn, aspect in aspects if aspect]):
            return None
        self.keep(trajectory, read)
        kept = self.recall(trajectory)
        aspects = [aspect for _, aspect in kept]
        served = wanted(aspects)
        return Instructions(id=f"{trajectory.id}#memory", tenant=trajectory.tenant, user_id=trajectory.user_id,
                            instructions=[ASPECTS[aspect] for aspect in served], aspects=served, read=aspects,
                            turns=[turn for turn, _ in kept], read_from=self.oldest(person))

    def restore(self, record: Instructions) -> None:
        """Go on from a person's record (published by this judge before it restarted, or another)."""
        person = (record.tenant, "", record.user_id or "")
        reads = [(turn, aspect) for turn, aspect in zip(record.turns, record.read) if ASPECTS.get(aspect)]
        self.keep_for(person, reversed(reads), record.read_from, replace=True)


def wanted(read: list[str]) -> list[str]:
    """The aspects most of `read` (newest first) ask for that are served (not `UNSERVED`); of two
    opposite ones, the one asked last."""
    most = most_asked(read)
    return [aspect for aspect in most if aspect not in UNSERVED and
            (OPPOSITES.get(aspect) not in most or read.index(aspect) < read.index(OPPOSITES[aspect]))]
