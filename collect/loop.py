"""The collect loop: turns and session events in, trajectories out.

Consumes the TRAFFIC stream with a durable consumer and feeds the `SessionTracker`. A record is
acknowledged only after the trajectory it went into has been published (or after it was found
to be a duplicate, or part of a session with nothing to train on), so a collector that dies
loses nothing: its unacknowledged records are redelivered to the next one, which rebuilds the
open sessions, and JetStream drops the re-publish of a trajectory already sent (same id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from bus import TRAFFIC_SUBJECTS, TRAJECTORY_SUBJECT, Bus, Delivery
from bus.process import repeat
from collect.tracker import Closed, SessionTracker
from config import FlywheelConfig

log = logging.getLogger(__name__)


class CollectLoop:
    def __init__(self, config: FlywheelConfig, bus_url: str, durable: str = "collect"):
        self.config = config
        self.bus_url = bus_url
        self.durable = durable
        self.tracker = SessionTracker(config.collect)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.bus = await Bus.connect(self.bus_url, name="collect")
        # Open sessions hold their records unacknowledged: allow many, for a long time.
        self.consumer = self.bus.consumer(
            TRAFFIC_SUBJECTS, self.durable, ack_wait_s=max(3600.0, 2 * self.config.collect.idle_timeout_s)
        )
        self._closed: list[Closed] = []
        self._task = asyncio.create_task(repeat(self._step, "collect"), name="collect")

    async def _step(self) -> None:
        deliveries: list[Delivery] = await self.consumer.fetch(batch=512, timeout_s=0.25)
        for delivery in deliveries:
            self._closed.extend(self.tracker.add(delivery.record, delivery))
        self._closed.extend(self.tracker.expire())
        if self._closed:  # what fails to publish stays here and is retried next step
            closed, self._closed = self._closed, []
            failures = await self._publish(closed)
            self._closed = [item for item, _ in failures]
            if failures:
                raise failures[0][1]

    async def _publish(self, closed: list[Closed]) -> list[tuple[Closed, BaseException]]:
        """Publish the trajectories (pipelined, each acknowledged by JetStream), then
        acknowledge the records that went into each published one. Returns what failed."""
        with_trajectory = [item for item in closed if item.trajectory is not None]
        errors = await self.bus.publish_all(TRAJECTORY_SUBJECT, [item.trajectory for item in with_trajectory])
        failed = {id(item): error for item, error in zip(with_trajectory, errors) if error is not None}
        failures = []
        for item in closed:
            error = failed.get(id(item))
            if error is None:
                try:
                    for delivery in item.handles:
                        await delivery.ack()
                except Exception as exc:  # published again next step: JetStream drops the repeat
                    error = exc
            if error is not None:
                failures.append((item, error))
        return failures

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.bus.close()

    def stats(self) -> dict[str, Any]:
        return {**self.tracker.counts, "open_sessions": self.tracker.open_sessions, "malformed": self.consumer.malformed}
