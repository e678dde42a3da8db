"""The teacher's memory of what each person asked for (`judge.teacher.memory`): one correction
teaches every later reply, not only the one it was about.

Without it a hint reaches one turn: the teacher, told the correction, scores the reply it was
about, and that is one sample's worth of distillation. With it the judge keeps each learner's
newest hints (a learner: the adapter the turn trains, else the end user, else the tenant), and
every later turn of theirs (in the same conversation and after) is scored by the teacher told
those hints too, its own hint first:
replies the person approved and replies to new questions included, until the hints fall out of
the memory. Distillation toward "the base model told what this person wants" then runs on every
reply of theirs, the memory's counterpart in the weights of the hints an app would put in the
prompt.

Held in the judge's memory only (lost when it restarts: the verdicts do not depend on it, only
how much the teacher says), bounded (`memory` hints a learner, `MAX_LEARNERS` learners, least
recently judged dropped first), and forgotten with the person: `forget` drops a tenant's or one
user's hints (the judge loop follows the audit log).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from flywheel.bus import Trajectory

MAX_LEARNERS = 10_000


class HintMemory:
    def __init__(self, size: int, max_learners: int = MAX_LEARNERS):
        self.size, self.max_learners = size, max_learners
        self._hints: OrderedDict[tuple[str, str], deque[tuple[str | None, str]]] = OrderedDict()

    @staticmethod
    def learner(trajectory: Trajectory) -> tuple[str, str]:
        """Whose hints these are: (tenant, the adapter the sample trains, else the end user, else "")."""
        return trajectory.tenant, trajectory.adapter or (f"user:{trajectory.user_id}" if trajectory.user_id else "")

    def recall(self, trajectory: Trajectory) -> list[str]:
        """The learner's remembered hints, newest first."""
        return [hint for _, hint in reversed(self._hints.get(self.learner(trajectory), ()))]

    def keep(self, trajectory: Trajectory, hints: list[str]) -> None:
        """Remember a trajectory's hints (in turn order) for its learner's later turns."""
        if not hints:
            return
        key = self.learner(trajectory)
        kept = self._hints.pop(key, None) or deque(maxlen=self.size)
        for hint in hints:
            if all(hint != old for _, old in kept):
                kept.append((trajectory.user_id, hint))
        self._hints[key] = kept
        while len(self._hints) > self.max_learners:
            self._hints.popitem(last=False)

    def teach(self, trajectory: Trajectory, hints: dict[int, str]) -> dict[int, str]:
        """Each turn's hint for the teacher: its own (when it has one), then the hints of the
        trajectory's earlier turns and what the learner asked for before, newest first; the
        trajectory's hints are remembered afterwards."""
        earlier = self.recall(trajectory)
        out = {}
        for k in range(len(trajectory.turns)):
            told = [hints[k]] if k in hints else []
            told += [hint for hint in earlier if hint not in told]
            if told:
                out[k] = " ".join(told)
            if k in hints and hints[k] not in earlier:
                earlier.insert(0, hints[k])
        self.keep(trajectory, [hints[k] for k in sorted(hints)])
        return out

    def forget(self, tenant: str, user: str | None = None) -> None:
        """Drop a tenant's hints, or one end user's."""
        for key in [key for key in self._hints if key[0] == tenant]:
            if user is None:
                del self._hints[key]
                continue
            kept = deque(((who, hint) for who, hint in self._hints[key] if who != user), maxlen=self.size)
            if kept:
                self._hints[key] = kept
            else:
                del self._hints[key]
