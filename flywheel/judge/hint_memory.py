"""The teacher's memory of what each person asked for (`judge.teacher.memory`): one correction
teaches every later reply, not only the one it was about.

Without it a hint reaches one turn: the teacher, told the correction, scores the reply it was
about, and that is one sample's worth of distillation. With it the judge keeps each person's
newest hints (a person: the end user of a tenant, on the adapter their turns train; a tenant's
traffic that names no user is one person), and every later turn of theirs (in the same
conversation and after) is scored by the teacher told those hints too, its own hint first:
replies the person approved and replies to new questions included, until the hints fall out of
the memory. Distillation toward "the base model told what this person wants" then runs on every
reply of theirs, the memory's counterpart in the weights of the hints an app would put in the
prompt. Only hints about turns the judge scored below zero are remembered (a correction, a
complaint; feedback text such as "Perfect!" teaches its own turn only).

Kept as flywheel/judge/people_memory.py keeps what the judge remembers of a person: bounded
(`memory` hints a person), in the judge's memory only, and forgotten with the person.
"""

from __future__ import annotations

from flywheel.bus import Trajectory
from flywheel.judge.people_memory import PeopleMemory


class HintMemory(PeopleMemory[str]):
    def teach(self, trajectory: Trajectory, hints: dict[int, str],
              remember: set[int] | None = None) -> dict[int, list[str]]:
        """Each turn's hints for the teacher: its own (when it has one), then the hints of the
        trajectory's earlier turns and what the person asked for before, newest first. The hints
        of the turns in `remember` (default: all) are remembered afterwards."""
        earlier = self.recall(trajectory)
        out = {}
        for k in range(len(trajectory.turns)):
            told = [hints[k]] if k in hints else []
            told += [hint for hint in earlier if hint not in told]
            if told:
                out[k] = told
            if k in hints and hints[k] not in earlier:
                earlier.insert(0, hints[k])
        self.keep(trajectory, [hints[k] for k in sorted(hints) if remember is None or k in remember])
        return out
