"""Publishes turn records and session events to the bus, off the response path.

`record()` never blocks and never raises: it puts the record on a bounded in-memory queue and
returns. One background task publishes the queue in order (so a session's feedback follows the
turns recorded before it), retrying with backoff while the bus is unreachable. When the queue is
full the record is dropped and counted (`dropped`), and the response still goes out.
"""

from __future__ import annotations

import asyncio
import logging

from bus import Bus, Record

log = logging.getLogger(__name__)


class Recorder:
    def __init__(self, bus: Bus, maxsize: int = 10_000):
        self._bus = bus
        self._queue: asyncio.Queue[tuple[str, Record]] = asyncio.Queue(maxsize)
        self.published = 0
        self.dropped = 0
        self.retries = 0

    def record(self, subject: str, record: Record) -> bool:
        """Queue a record for publishing; False (and counted) if the queue is full."""
        try:
            self._queue.put_nowait((subject, record))
            return True
        except asyncio.QueueFull:
            self.dropped += 1
            log.error("recorder queue full: dropped %s %s", type(record).__name__, record.id)
            return False

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def run(self) -> None:
        """Publish forever; cancel to stop (call `flush` first to drain)."""
        while True:
            subject, record = await self._queue.get()
            delay = 0.05
            while True:
                try:
                    await self._bus.publish(subject, record)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.retries += 1
                    log.warning("publish of %s failed (%s); retrying in %.2fs", record.id, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
            self.published += 1
            self._queue.task_done()

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything queued so far is published."""
        await asyncio.wait_for(self._queue.join(), timeout_s)
