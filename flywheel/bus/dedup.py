"""A bounded memory of record ids, for consumers that must be idempotent.

Delivery on the bus is at-least-once: a record comes again when its consumer died before
acknowledging it, when an acknowledgement was lost, or when a producer published it twice
beyond JetStream's duplicate window. Consumers remember the ids they have handled and drop
repeats. The memory keeps the most recent `capacity` ids (an `LRU`: the least recently added
forgotten first), which is far more than can be in flight at once.
"""

from __future__ import annotations

from collections.abc import Iterable

from flywheel.lru import LRU


class RecentIds:
    def __init__(self, capacity: int, ids: Iterable[str] = ()):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._ids: LRU[str, None] = LRU(capacity)
        self.add(ids)

    def __contains__(self, record_id: str) -> bool:
        return record_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, ids: Iterable[str]) -> None:
        for record_id in ids:
            self._ids[record_id] = None

    def to_list(self) -> list[str]:
        """Oldest first (what `RecentIds(capacity, ids)` takes back)."""
        return list(self._ids)
