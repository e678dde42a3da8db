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

Held in the judge's memory only (lost when it restarts: the verdicts do not depend on it, only
how much the teacher says), bounded (`memory` hints a person, `MAX_PEOPLE` people, those given a
hint least recently dropped first), and forgotten with the person: `forget` drops a tenant's or
one user's hints, and a trajectory collected before that is not remembered again (the judge loop
follows the audit log).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from flywheel.bus import Trajectory
from flywheel.tenants.forgotten import Forgettings, forgets

MAX_PEOPLE = 10_000


class HintMemory:
    def __init__(self, size: int, max_people: int = MAX_PEOPLE):
        self.size, self.max_people = size, max_people
        self._hints: OrderedDict[tuple[str, str, str], deque[str]] = OrderedDict()
        self._forgotten = Forgettings()
        """Who was forgotten, and when (Unix time)."""

    @staticmethod
    def person(trajectory: Trajectory) -> tuple[str, str, str]:
        """Whose hints these are: (tenant, the adapter the turns train, the end user)."""
        return trajectory.tenant, trajectory.adapter or "", trajectory.user_id or ""

    def recall(self, trajectory: Trajectory) -> list[str]:
        """The person's remembered hints, newest first."""
        return list(reversed(self._hints.get(self.person(trajectory), ())))

    def keep(self, trajectory: Trajectory, hints: list[str]) -> None:
        """Remember a trajectory's hints (in turn order) for its person's later turns; nothing of
        a trajectory collected before its person was forgotten."""
        tenant, _, user = key = self.person(trajectory)
        if not hints or self._forgotten.since(tenant, user or None, trajectory.created_at):
            return
        kept = self._hints.pop(key, None) or deque(maxlen=self.size)
        for hint in hints:
            if hint in kept:
                kept.remove(hint)
            kept.append(hint)
        self._hints[key] = kept
        while len(self._hints) > self.max_people:
            self._hints.popitem(last=False)

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

    def forget(self, tenant: str, user: str | None, at: float) -> None:
        """Drop a tenant's hints, or one end user's; forgotten at time `at` (a trajectory
        collected until then is not remembered again)."""
        self._forgotten.add(tenant, user, at)
        for key in [key for key in self._hints if forgets((tenant, user), (key[0], key[2]))]:
            del self._hints[key]
