"""Whole task groups for training steps.

Advantages are normalised within a task group (the samples of one task: `X-Task-Id`, or the n
choices of one request), so a step must see each group whole, not the fragment that happened to
arrive before the batch filled up. The batcher holds samples by group and hands out only
complete groups:

- a sample without a task id is a group of one, complete at once (a live request);
- a group whose size is known (`Trajectory.group_size`) is complete when that many samples
  have arrived;
- a group of unknown size, or one that never fills (a member was unscored, or lost to its
  client), is complete once no member has arrived for `group_timeout_s`
  (`train.group_timeout_s`); counted in `groups_timed_out`.

A step takes the oldest complete groups (by first arrival) whose sizes add up to at most the
batch size: at least one group, however large. It is ready once complete groups hold a batch.
A group with any member older than the staleness bound is dropped whole.

A sample that arrives for a group already trained starts a new fragment of it: the group was
split across steps, counted in `groups_split` (0 whenever group sizes are known and the
timeout is longer than a group takes to arrive).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flywheel.bus import Sample
from flywheel.bus.dedup import RecentIds


@dataclass
class Member:
    """A sample and every delivery of it the bus made (all are acknowledged together)."""

    sample: Sample
    deliveries: list[Any]


@dataclass
class Group:
    key: str
    size: int | None
    first_at: float
    last_at: float
    members: dict[str, Member] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [m.sample for m in self.members.values()]

    @property
    def deliveries(self) -> list[Any]:
        return [d for m in self.members.values() for d in m.deliveries]


class GroupBatcher:
    def __init__(self, batch_size: int, group_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 remember: int = 100_000):
        self.batch_size = batch_size
        self.group_timeout_s = group_timeout_s
        self._clock = clock
        self._groups: dict[str, Group] = {}
        self._group_of: dict[str, str] = {}
        """Sample id -> its group's key, for every sample held."""
        self._taken = RecentIds(remember)
        self.counts = {"groups_split": 0, "groups_timed_out": 0}

    def __len__(self) -> int:
        """Samples held."""
        return sum(len(g.members) for g in self._groups.values())

    def holds(self, sample_id: str) -> Member | None:
        key = self._group_of.get(sample_id)
        return None if key is None else self._groups[key].members[sample_id]

    def add(self, sample: Sample, delivery: Any) -> None:
        trajectory = sample.trajectory
        key = trajectory.task_id if trajectory.task_id is not None else f"sample:{sample.id}"
        now = self._clock()
        group = self._groups.get(key)
        if group is None:
            if key in self._taken:
                self.counts["groups_split"] += 1
            group = self._groups[key] = Group(key, trajectory.group_size if trajectory.task_id else 1, now, now)
        group.members[sample.id] = Member(sample, [delivery])
        self._group_of[sample.id] = key
        group.last_at = now

    def deliveries(self) -> Iterator[Any]:
        """Every delivery held (to keep them from being redelivered meanwhile)."""
        for group in self._groups.values():
            yield from group.deliveries

    def drop_stale(self, is_stale: Callable[[Sample], bool]) -> list[Group]:
        """Remove and return the groups with a member that `is_stale`."""
        stale = [g for g in self._groups.values() if any(is_stale(s) for s in g.samples)]
        for group in stale:
            self._remove(group)
        return stale

    def _remove(self, group: Group) -> None:
        del self._groups[group.key]
        for sample_id in group.members:
            del self._group_of[sample_id]

    @staticmethod
    def _full(group: Group) -> bool:
        return group.size is not None and len(group.members) >= group.size

    def _complete(self, group: Group, now: float) -> bool:
        return self._full(group) or now - group.last_at >= self.group_timeout_s

    def take(self, ready: Callable[[Group], bool] = lambda group: True) -> list[Group] | None:
        """The next step's groups (of those `ready`), or None while complete ones hold fewer than a batch."""
        now = self._clock()
        complete = sorted((g for g in self._groups.values() if self._complete(g, now) and ready(g)), key=lambda g: g.first_at)
        if sum(len(g.members) for g in complete) < self.batch_size:
            return None
        taken: list[Group] = []
        count = 0
        for group in complete:
            if taken and count + len(group.members) > self.batch_size:
                break
            taken.append(group)
            count += len(group.members)
        for group in taken:
            self._remove(group)
            self._taken.add([group.key])
            if not self._full(group):
                self.counts["groups_timed_out"] += 1
        return taken
