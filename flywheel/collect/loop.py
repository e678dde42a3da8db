"""The collect loop: turns and session events in, trajectories out.

Consumes the TRAFFIC stream with a durable consumer and feeds the `SessionTracker`. A record is
acknowledged only after the trajectory it went into has been published (or after it was found
to be a duplicate, or part of a session with nothing to train on); until then it is kept from
redelivery with progress acknowledgements (`flywheel/bus/keepalive.py`), so the ack wait is short. A
collector that dies loses nothing: within an ack wait its records are redelivered to the next
one, which rebuilds the open sessions in stream order before taking anything newer
(`flywheel/bus/restart_barrier.py`), and JetStream drops the re-publish of a trajectory already sent (same
id, within its duplicate window). It also sweeps the large records' bodies past their
tenant's retention (flywheel/bus/large.py), and reads the audit log, all of it: a tenant or user
forgotten (`flywheel forget`, from when it begins) leaves nothing of theirs made before it in what
the collector holds or is sent later, nor in a trajectory waiting to be published
(`SessionTracker.forget`, flywheel/collect/forgotten_people.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from flywheel.bus import TRAFFIC_SUBJECTS, TRAJECTORY_SUBJECT, Delivery
from flywheel.bus.consumer_loop import ConsumerLoop
from flywheel.bus.restart_barrier import RestartBarrier
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.collect.tracker import Closed, SessionTracker
from flywheel.config import FlywheelConfig
from flywheel.runtime import cancel_and_wait, repeat
from flywheel.tenants.forgotten import forget_of

log = logging.getLogger(__name__)
SWEEP_S = 60.0
"""How often the collector deletes large records' bodies past their tenant's retention."""


class CollectLoop(ConsumerLoop):
    name = "collect"
    subjects = TRAFFIC_SUBJECTS

    def __init__(self, config: FlywheelConfig, bus_url: str, durable: str = "collect"):
        super().__init__(config, bus_url, durable)
        self.tracker = SessionTracker(config.collect)
        self._closed: list[Closed] = []
        self._forgotten: list[tuple[str, str | None, float]] = []
        """Forgets read on the audit log (who, when), applied at the next step."""

    async def prepare(self) -> None:
        self._barrier = await RestartBarrier.of(self.consumer, self.config.bus.ack_wait_s)
        self._sweeper = asyncio.create_task(repeat(self._sweep_large, "collect.sweep"), name="collect.sweep")
        self._forgetting = asyncio.create_task(repeat(self._follow_forgetting, "collect.forget"), name="collect.forget")

    async def _follow_forgetting(self) -> None:
        """Every forget, from the first (a restarted collector, or this follower, must miss none)."""
        async for entry in self.bus.follow(AUDIT_SUBJECT, from_last=False, from_first=True):
            if (forget := forget_of(entry)) is not None:
                self._forgotten.append(forget)

    async def _sweep_large(self) -> None:
        """Large records' bodies past their tenant's retention go (flywheel/bus/large.py), every minute."""
        await self.bus.large.sweep()
        await asyncio.sleep(SWEEP_S)

    async def finish(self) -> None:
        await cancel_and_wait([self._sweeper, self._forgetting])

    def held(self) -> list[Delivery]:
        return [*self.tracker.handles(), *self._barrier.held, *(h for item in self._closed for h in item.handles)]

    async def step(self) -> None:
        deliveries = self._barrier.hold(await self.consumer.fetch(batch=512, timeout_s=0.25))
        if deliveries is None:
            return
        for delivery in deliveries:
            self._closed.extend(self.tracker.add(delivery.record, delivery))
        while self._forgotten:
            self._closed.extend(self.tracker.forget(*self._forgotten.pop(0)))
            self._closed = [Closed([], item.handles) if any(map(self.tracker.forgotten.in_trajectory, item.trajectories))
                            else item for item in self._closed]
        self._closed.extend(self.tracker.expire())
        if self._closed:  # what fails to publish stays here and is retried next step
            closed, self._closed = self._closed, []
            failures = await self._publish(closed)
            self._closed = [item for item, _ in failures]
            if failures:
                raise failures[0][1]

    async def _publish(self, closed: list[Closed]) -> list[tuple[Closed, BaseException]]:
        """Publish the trajectories (pipelined, each acknowledged by JetStream), then acknowledge
        the records of each session whose trajectories were all published. Returns what failed."""
        trajectories = [(item, trajectory) for item in closed for trajectory in item.trajectories]
        errors = await self.bus.publish_all(TRAJECTORY_SUBJECT, [trajectory for _, trajectory in trajectories])
        failed = {id(item): error for (item, _), error in zip(trajectories, errors) if error is not None}
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

    def stats(self) -> dict[str, Any]:
        return {**self.tracker.counts, "open_sessions": self.tracker.open_sessions, "malformed": self.consumer.malformed,
                "recovering": not self._barrier.open}
