"""A map of bounded size that forgets the least recently used entry first.

Every long-lived process holds maps keyed by something clients or the bus keep producing
(sessions, stored responses, compiled grammars, record ids); each is one `LRU`. Writing an entry
or reading it with `get` makes it the most recent; `in` and `peek` look without touching.
Capacity 0 keeps nothing (a feature turned off).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be at least 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def __setitem__(self, key: K, value: V) -> None:
        if self.capacity == 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value (now the most recently used), or `default`."""
        if key not in self._items:
            return default
        self._items.move_to_end(key)
        return self._items[key]

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value without making it recent, or `default`."""
        return self._items.get(key, default)

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Forget `key`; its value, or `default`."""
        return self._items.pop(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._items)
