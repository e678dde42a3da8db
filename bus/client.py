"""Connecting to the bus, publishing records, and consuming them durably.

`Bus.connect(url)` opens a NATS connection that reconnects forever (a loop survives a NATS
restart) and makes sure the streams of `bus.streams` exist. `publish` sets `Nats-Msg-Id` to the
record id, so JetStream drops a re-publish of the same record inside its duplicate window.
`consumer` returns a durable pull consumer: it resumes where the named consumer left off after a
restart, and delivers each message until it is acked (at-least-once). A message that does not
decode as its subject's record type is terminated and counted, never allowed to crash a loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import nats
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.errors import NotFoundError

from bus.records import Record, decode, encode
from bus.streams import RECORD_TYPES, STREAMS, StreamSpec

log = logging.getLogger(__name__)


@dataclass
class Delivery:
    """A decoded record and the message it came in, for acknowledging."""

    record: Record
    msg: Msg

    async def ack(self) -> None:
        await self.msg.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        await self.msg.nak(delay=delay_s)


class Consumer:
    """A durable pull consumer over a subject (wildcards allowed); decodes by each message's subject."""

    def __init__(self, bus: "Bus", subject: str, durable: str, ack_wait_s: float, max_ack_pending: int):
        self._bus = bus
        self.subject = subject
        self.durable = durable
        self._config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_ack_pending=max_ack_pending,
            filter_subject=subject,
        )
        self._sub = None
        self.malformed = 0
        """Messages terminated because they did not decode."""

    async def _subscription(self):
        if self._sub is None:
            self._sub = await self._bus.js.pull_subscribe(
                self.subject, durable=self.durable, config=self._config
            )
        return self._sub

    async def fetch(self, batch: int = 256, timeout_s: float = 1.0) -> list[Delivery]:
        """Up to `batch` records; an empty list when none arrived within `timeout_s`."""
        sub = await self._subscription()
        try:
            msgs = await sub.fetch(batch, timeout=timeout_s)
        except (NatsTimeoutError, asyncio.TimeoutError):  # nats-py raises either when nothing came
            return []
        out = []
        for msg in msgs:
            kind = RECORD_TYPES.get(msg.subject)
            try:
                if kind is None:
                    raise msgspec.ValidationError(f"no record type is defined for {msg.subject}")
                out.append(Delivery(decode(msg.data, kind), msg))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.malformed += 1
                log.error("dropping malformed record on %s: %s", msg.subject, exc)
                await msg.term()
        return out

    async def __aiter__(self) -> AsyncIterator[Delivery]:
        while True:
            for delivery in await self.fetch():
                yield delivery


class Bus:
    """A connection to NATS JetStream with the Flywheel streams in place."""

    def __init__(self, nc: nats.NATS):
        self.nc = nc
        self.js = nc.jetstream()

    @classmethod
    async def connect(cls, url: str, name: str = "flywheel", ensure_streams: bool = True) -> "Bus":
        nc = await nats.connect(
            url,
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
        )
        bus = cls(nc)
        if ensure_streams:
            await bus.ensure_streams()
        return bus

    async def ensure_streams(self, specs: list[StreamSpec] | None = None) -> None:
        for spec in specs or list(STREAMS.values()):
            config = StreamConfig(
                name=spec.name,
                subjects=list(spec.subjects),
                max_age=spec.max_age_s,
                max_msgs_per_subject=spec.max_msgs_per_subject,
                duplicate_window=120.0,
            )
            try:
                await self.js.stream_info(spec.name)
                await self.js.update_stream(config)
            except NotFoundError:
                await self.js.add_stream(config)

    async def publish(self, subject: str, record: Record, timeout_s: float = 10.0) -> None:
        """Publish and wait for JetStream's ack (the record is then durable)."""
        if not isinstance(record, RECORD_TYPES[subject]):
            raise TypeError(f"{subject} carries {RECORD_TYPES[subject].__name__}, not {type(record).__name__}")
        await self.js.publish(
            subject, encode(record), timeout=timeout_s, headers={"Nats-Msg-Id": record.id}
        )

    def consumer(
        self, subject: str, durable: str, ack_wait_s: float = 600.0, max_ack_pending: int = 100_000
    ) -> Consumer:
        return Consumer(self, subject, durable, ack_wait_s, max_ack_pending)

    async def last(self, subject: str) -> Record | None:
        """The newest record on a subject, or None if there is none."""
        stream = await self.js.find_stream_name_by_subject(subject)
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        return decode(raw.data, RECORD_TYPES[subject])

    async def follow(self, subject: str, from_last: bool = True) -> AsyncIterator[Record]:
        """Every new record on a subject (starting with the newest existing one if `from_last`),
        through an ephemeral ordered consumer: for state every process must see, like weights."""
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        policy = DeliverPolicy.LAST if from_last else DeliverPolicy.NEW
        sub = await self.js.subscribe(subject, cb=queue.put, ordered_consumer=True, deliver_policy=policy)
        kind = RECORD_TYPES[subject]
        try:
            while True:
                msg = await queue.get()
                try:
                    yield decode(msg.data, kind)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    log.error("ignoring malformed %s record: %s", kind.__name__, exc)
        finally:
            await sub.unsubscribe()

    async def close(self) -> None:
        """Close the connection. Publishes are acknowledged before `publish` returns, so there is
        nothing to drain (draining would wait on consumers' outstanding pull requests)."""
        if not self.nc.is_closed:
            try:
                await self.nc.close()
            except ConnectionError:  # the server went first; nothing left to close cleanly
                pass
