"""The skeleton every consuming loop shares (collect, judge, train): connect to the bus, pull from a
durable consumer, keep what it holds alive, repeat its step forever, stop cleanly.

A loop says what it consumes (`subjects`), what one step does (`step`: fetch, work, publish,
acknowledge), which deliveries it holds unacknowledged (`held`: kept from redelivery with
progress acknowledgements, `flywheel/bus/keepalive.py`, so the ack wait can stay short), and
optionally what to do once connected (`prepare`; a start it refuses closes the connection again)
and once its tasks have stopped, before the bus closes (`finish`). A step that raises is logged
and retried (`flywheel.runtime.repeat`): a passing fault never ends a loop. Acknowledging stays
the loop's own business, since only it knows when what it made from a record is durable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, ClassVar

from flywheel.bus.client import Bus, Consumer, Delivery
from flywheel.bus.keepalive import keep_alive
from flywheel.config import FlywheelConfig
from flywheel.config.tenants import retention_s
from flywheel.runtime import cancel_and_wait, repeat


class ConsumerLoop:
    name: ClassVar[str]
    """The loop's name: its bus connection's, its log's and its durable consumer's by default."""
    subjects: ClassVar[str]
    """What it consumes (wildcards allowed)."""

    bus: Bus
    consumer: Consumer

    def __init__(self, config: FlywheelConfig, bus_url: str, durable: str | None = None):
        self.config = config
        self.bus_url = bus_url
        self.durable = durable or self.name
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> Any:
        self.bus = await Bus.connect(self.bus_url, name=self.name, replicas=self.config.bus.replicas,
                                  retention=retention_s(self.config.tenants))
        ack_wait = self.config.bus.ack_wait_s
        self.consumer = self.bus.consumer(self.subjects, self.durable, ack_wait_s=ack_wait)
        try:
            await self.prepare()  # may start tasks of its own (in `_tasks`, stopped with the others)
        except BaseException:  # refused (a config error, another trainer's run lock): nothing stays behind
            await cancel_and_wait(self._tasks)
            self._tasks = []
            await self.bus.close()
            raise
        self._tasks += [
            asyncio.create_task(repeat(self.step, self.name), name=self.name),
            asyncio.create_task(repeat(lambda: keep_alive(self.held, ack_wait), f"{self.name}.keepalive"),
                                name=f"{self.name}.keepalive"),
        ]

    async def prepare(self) -> None:
        """Once connected, before the first step (restore state, open files)."""

    async def step(self) -> None:
        raise NotImplementedError

    def held(self) -> Iterable[Delivery]:
        """Deliveries held unacknowledged for longer than a step."""
        return ()

    async def stop(self) -> None:
        """Cancel the step and the keep-alive, `finish`, hand back what was held and is not
        acknowledged by then, close the bus. Handed back (nak), a record goes to the next
        consumer at once; left unacknowledged it would wait out its ack wait, and a collector
        that starts holds everything until its predecessor's records are back
        (flywheel/bus/restart_barrier.py). A crash still leaves them to the ack wait."""
        started = bool(self._tasks)
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if started:
            held = {id(d): d for d in self.held()}  # before `finish`, which may drop some (cancelled judgements)
            await self.finish()
            held.update((id(d), d) for d in self.held())
            await self.consumer.hand_back(held.values())
        await self.bus.close()

    async def finish(self) -> None:
        """After the tasks stopped, before the bus closes (a last checkpoint, closing files)."""
