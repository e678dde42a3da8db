"""What the judge remembers of each person: their newest few things, bounded, and forgotten with them.

A person is an end user of a tenant on the adapter their turns train (a tenant's traffic that
names no user is one person). The teacher's memory of hints (flywheel/judge/hint_memory.py) and
the requests practice replays (flywheel/judge/practice.py) are kept so: in the judge's memory only
(lost when it restarts: the verdicts do not depend on them), bounded (`size` things a person,
`max_people` people, those given something least recently dropped first), and forgotten with the
person: `forget` drops a tenant's or one user's, and a trajectory collected before that is not
remembered again (the judge loop follows the audit log; a clear of a person's memory,
`memory.clear`, drops the same way). A conversation kept out of the memory (a turn of it said
`X-Flywheel-Memory: false`: `Turn.memory`) is neither remembered nor given what is remembered.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

from flywheel.bus import Trajectory
from flywheel.tenants.forgotten import Forgettings, forgets

MAX_PEOPLE = 10_000
T = TypeVar("T")


class PeopleMemory(Generic[T]):
    """Each person's newest `size` things (two with the same `key`: the newer kept); see the module."""

    def __init__(self, size: int, key: Callable[[T], Hashable] = lambda item: item, max_people: int = MAX_PEOPLE):
        self.size, self.key, self.max_people = size, key, max_people
        self._kept: OrderedDict[tuple[str, str, str], deque[T]] = OrderedDict()
        self._forgotten = Forgettings()
        """Who was forgotten, and when (Unix time)."""
        self._made: dict[tuple[str, str, str], float] = {}
        """When the oldest thing kept of each person was made (at most: the oldest may have been pushed out)."""

    @staticmethod
    def person(trajectory: Trajectory) -> tuple[str, str, str]:
        """Whose things these are: (tenant, the adapter the turns train, the end user)."""
        return trajectory.tenant, trajectory.adapter or "", trajectory.user_id or ""

    @staticmethod
    def kept_out(trajectory: Trajectory) -> bool:
        """Whether the conversation was kept out of the memory (a turn said `X-Flywheel-Memory: false`)."""
        return not all(turn.memory for turn in trajectory.turns)

    def recall(self, trajectory: Trajectory) -> list[T]:
        """What the trajectory's person gave, newest first (none where it was `kept_out`)."""
        return [] if self.kept_out(trajectory) else list(reversed(self._kept.get(self.person(trajectory), ())))

    def keep(self, trajectory: Trajectory, items: Iterable[T]) -> None:
        """Remember a trajectory's `items` (oldest first) for its person; nothing of a trajectory
        collected before its person was forgotten, or `kept_out`."""
        if not self.kept_out(trajectory):
            self.keep_for(self.person(trajectory), items, trajectory.created_at)

    def oldest(self, person: tuple[str, str, str]) -> float:
        """When the oldest thing kept of `person` was made (at most; they have something kept)."""
        return self._made[person]

    def forgotten_since(self, person: tuple[str, str, str], made: float) -> bool:
        """Whether `person` was forgotten after Unix time `made`."""
        tenant, _, user = person
        return self._forgotten.since(tenant, user or None, made)

    def keep_for(self, person: tuple[str, str, str], items: Iterable[T], made: float, replace: bool = False) -> None:
        """Remember `items` (oldest first) for `person`, made at Unix time `made` (nothing made
        before the person was forgotten); `replace`: instead of what they gave before."""
        items = list(items)
        if not items or self.forgotten_since(person, made):
            return
        before = self._kept.pop(person, None)
        kept = deque(maxlen=self.size) if replace or before is None else before
        self._made[person] = made if kept is not before else min(self._made[person], made)
        for item in items:
            for same in [old for old in kept if self.key(old) == self.key(item)]:
                kept.remove(same)
            kept.append(item)
        self._kept[person] = kept
        while len(self._kept) > self.max_people:
            del self._made[self._kept.popitem(last=False)[0]]

    def forget(self, tenant: str, user: str | None, at: float) -> None:
        """Drop what a tenant gave, or one end user; forgotten at time `at` (a trajectory collected
        until then is not remembered again). A forget heard again (the judge reads the audit log
        from its start after a restart) drops nothing a person gave after it, when they came back."""
        again = self._forgotten.since(tenant, user, at)
        self._forgotten.add(tenant, user, at)
        for person in [person for person in self._kept if forgets((tenant, user), (person[0], person[2]))
                       and not (again and self._made[person] > at)]:
            del self._kept[person], self._made[person]
