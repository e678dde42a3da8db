"""Numbered slots shared by workers running at once: an episode or a build job holds one from
start to end, and a sandbox's uid derives from it, so two sandboxes never share one.

One pool serves threads (`take`, or `with pool.held() as slot`) and coroutines (`await
take_async()`, or `async with pool.held_async() as slot`) alike. `give` returns a slot from
anywhere, also later than its holder ended (a crashed environment worker's slot goes back once
its replacement answers). Waiters are served first come, first served; a coroutine cancelled
while it waits takes nothing with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator


class SlotPool:
    def __init__(self, slots: Iterable[int]):
        self._lock = threading.Lock()
        self._free: deque[int] = deque(slots)
        self._waiters: deque[Callable[[int], None]] = deque()
        """How to hand a slot to each waiter, oldest first."""

    def __len__(self) -> int:
        """Slots free now."""
        return len(self._free)

    def give(self, slot: int) -> None:
        with self._lock:
            if not self._waiters:
                self._free.append(slot)
                return
            hand = self._waiters.popleft()
        hand(slot)

    def take(self) -> int:
        """A free slot, waiting in this thread until there is one."""
        with self._lock:
            if self._free:
                return self._free.popleft()
            box: queue.SimpleQueue[int] = queue.SimpleQueue()
            self._waiters.append(box.put)
        return box.get()

    async def take_async(self) -> int:
        """A free slot, waiting on the event loop until there is one."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free:
                return self._free.popleft()
            future: asyncio.Future[int] = loop.create_future()
            self._waiters.append(lambda slot: loop.call_soon_threadsafe(self._hand, future, slot))
        return await future

    def _hand(self, future: asyncio.Future[int], slot: int) -> None:
        if future.cancelled():  # its waiter gave up: the slot goes to the next one
            self.give(slot)
        else:
            future.set_result(slot)

    @contextlib.contextmanager
    def held(self) -> Iterator[int]:
        slot = self.take()
        try:
            yield slot
        finally:
            self.give(slot)

    @contextlib.asynccontextmanager
    async def held_async(self) -> AsyncIterator[int]:
        slot = await self.take_async()
        try:
            yield slot
        finally:
            self.give(slot)
