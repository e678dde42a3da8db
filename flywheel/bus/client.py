"""Connecting to the bus, publishing records, and consuming them durably.

`Bus.connect(url)` opens a NATS connection that reconnects forever (a loop survives a NATS
restart) and makes sure the streams of `flywheel.bus.streams` exist. `publish` sets `Nats-Msg-Id` to the
record id, so JetStream drops a re-publish of the same record inside its duplicate window;
`publish_all` pipelines many (`flywheel/bus/acks.py`). `consumer` returns a durable pull consumer
(`flywheel/bus/pull.py`): it resumes where the named consumer left off after a restart, and delivers
each message until it is acked (at-least-once). A message that does not decode as its
subject's record type is terminated and counted, never allowed to crash a loop. `resolve`
attaches to a `Sample` the trajectory it refers to; `recent` reads a subject's records among its
stream's newest messages (the promotion gate's sample of traffic). Records of any size are carried whole: one
larger than a NATS message goes through the object store (`flywheel/bus/large.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from flywheel.bus.acks import PublishAcks
from flywheel.bus.large import HEADER, HEADROOM, LargeRecords, is_large, read_payload
from flywheel.bus.pull import PullRequests
from flywheel.bus.records import Record, Sample, Trajectory, decode, encode, tenant_of
from flywheel.bus.streams import STREAMS, TRAJECTORIES, StreamSpec, carried_by, record_type

log = logging.getLogger(__name__)

JETSTREAM_WAIT_S = 60.0
"""How long a process's start asks again for its streams when JetStream does not answer."""


@dataclass
class Delivery:
    """A decoded record and the message it came in, for acknowledging."""

    record: Record
    msg: Msg

    @property
    def stream_seq(self) -> int:
        """The message's sequence number in its stream (how a `Sample` refers to a trajectory)."""
        return self.msg.metadata.sequence.stream

    async def ack(self) -> None:
        await self.msg.ack()

    async def in_progress(self) -> None:
        """Still being worked on: restart the ack wait (JetStream's `+WPI`)."""
        await self.msg.in_progress()

    async def nak(self, delay_s: float | None = None) -> None:
        await self.msg.nak(delay=delay_s)

    async def term(self) -> None:
        """Never deliver this message again."""
        await self.msg.term()


HAND_BACK_S = 2.0
"""The longest a stopping consumer spends handing back what it holds."""


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
        self._pull: PullRequests | None = None
        self.malformed = 0
        """Messages terminated because they did not decode."""

    async def _requests(self) -> PullRequests:
        """Create the durable consumer, or update an existing one to this configuration (its
        position and pending records are kept), then pull from it."""
        if self._pull is None:
            js = self._bus.js
            self.stream = await js.find_stream_name_by_subject(self.subject)
            await js.add_consumer(self.stream, config=self._config)
            self._pull = PullRequests(self._bus.nc, self.stream, self.durable)
        return self._pull

    async def unacknowledged(self) -> tuple[int, int]:
        """(how many records were delivered and not acknowledged yet, the highest stream
        sequence delivered so far): what a previous consumer still held when it stopped."""
        await self._requests()
        info = await self._bus.js.consumer_info(self.stream, self.durable)
        return info.num_ack_pending, info.delivered.stream_seq

    async def hand_back(self, deliveries: Iterable[Delivery]) -> None:
        """Stop pulling, and give `deliveries` (and what arrived after the last fetch) back to
        JetStream, which redelivers them now instead of when their ack wait runs out. A delivery
        settled already (acknowledged, or a redelivery held with its first) is passed over. Best
        effort, bounded by `HAND_BACK_S`: with the server away, what is not handed back comes back
        when its ack wait runs out, as after a crash."""
        deliveries = list(deliveries)
        try:
            async with asyncio.timeout(HAND_BACK_S):
                late = await self._pull.close() if self._pull is not None else []
                await asyncio.gather(*(d.nak() for d in deliveries), *(m.nak() for m in late), return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("%s: could not hand back %d records (%r); they come back after their ack wait",
                        self.durable, len(deliveries), exc)

    async def fetch(self, batch: int = 256, timeout_s: float = 1.0) -> list[Delivery]:
        """Up to `batch` records; an empty list when none arrived within `timeout_s`."""
        msgs = await (await self._requests()).pull(batch, timeout_s)
        out = []
        for msg in msgs:
            kind = record_type(msg.subject)
            try:
                if kind is None:
                    raise msgspec.ValidationError(f"no record type is defined for {msg.subject}")
                data = await read_payload(self._bus, msg.data, msg.headers) if is_large(msg.headers) else msg.data
                out.append(Delivery(decode(data, kind), msg))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.malformed += 1
                log.error("dropping malformed record on %s: %s", msg.subject, exc)
                await msg.term()
        return out

    async def __aiter__(self) -> AsyncIterator[Delivery]:
        while True:
            for delivery in await self.fetch():
                yield delivery


def _outcome(sent: asyncio.Future | BaseException, timeout_s: float) -> BaseException | None:
    if not isinstance(sent, asyncio.Future):
        return sent
    if not sent.done():
        sent.cancel()
        return TimeoutError(f"no acknowledgement from JetStream within {timeout_s:g}s")
    return sent.exception()


class Bus:
    """A connection to NATS JetStream with the Flywheel streams in place."""

    def __init__(self, nc: nats.NATS, replicas: int = 1, retention: Mapping[str, float] | None = None):
        self.nc = nc
        self.js = nc.jetstream()
        self.replicas = replicas
        self.retention = dict(retention or {})
        """Tenant -> seconds its records are kept (`Nats-TTL`); a tenant not named: the streams' age."""
        self._acks = PublishAcks(nc)
        self.large = LargeRecords(self.js, replicas)

    @property
    def publishes_in_flight(self) -> int:
        """Records sent whose JetStream acknowledgement has neither arrived nor been given up on."""
        return self._acks.outstanding

    @classmethod
    async def connect(cls, url: str, name: str = "flywheel", ensure_streams: bool = True, replicas: int = 1,
                      retention: Mapping[str, float] | None = None) -> "Bus":
        """Connect to `url`: one server, or several of a cluster separated by commas (the client
        picks one and fails over to the others). The streams are kept in `replicas` copies, and a
        tenant's records published here for `retention[tenant]` seconds (its `retention_days`).
        After a reconnect, publishes still waiting for their acknowledgement are sent again."""
        bus: Bus | None = None

        async def reconnected() -> None:
            if bus is not None:
                await bus._acks.resend()

        nc = await nats.connect(
            [server.strip() for server in url.split(",")],
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            reconnected_cb=reconnected,
        )
        bus = cls(nc, replicas, retention)
        if ensure_streams:
            await bus.ensure_streams()
        return bus

    async def ensure_streams(self, specs: list[StreamSpec] | None = None) -> None:
        """Create each stream, or bring it up to date; JetStream not answering yet (a cluster that lost
        a member elects a leader first: a trainer starting then died of it in a drill) is asked
        again for up to `JETSTREAM_WAIT_S`."""
        for spec in specs or list(STREAMS.values()):
            deadline = time.monotonic() + JETSTREAM_WAIT_S
            while True:
                try:
                    await self._ensure_stream(spec)
                    break
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ServiceUnavailableError) as exc:
                    if time.monotonic() > deadline:
                        raise
                    log.warning("%s: JetStream did not answer (%r); asking again", spec.name, exc)
                    await asyncio.sleep(1.0)

    async def _ensure_stream(self, spec: StreamSpec) -> None:
        config = StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            max_age=spec.max_age_s,
            max_msgs_per_subject=spec.max_msgs_per_subject,
            duplicate_window=120.0,
            allow_direct=True,  # `resolve` reads trajectories by sequence number
            allow_msg_ttl=spec.tenant_records,  # a tenant's `retention_days`
            num_replicas=self.replicas,
        )
        try:
            carried = (await self.js.stream_info(spec.name)).config.subjects or []
            await self.js.update_stream(config)
        except NotFoundError:
            await self.js.add_stream(config)
            return
        for subject in set(carried) - set(spec.subjects):  # an older version's: nothing reads or forgets them now
            if "*" in subject or ">" in subject:  # its filter could take what the new subjects carry
                log.warning("%s: records on %s, a subject it no longer carries, are left", spec.name, subject)
                continue
            await self.js.purge_stream(spec.name, subject=subject)
            log.warning("%s: records on %s, a subject it no longer carries, purged", spec.name, subject)

    async def publish(self, subject: str, record: Record, timeout_s: float = 10.0) -> None:
        """Publish and wait for JetStream's ack (the record is then durable)."""
        [error] = await self.publish_all(subject, [record], timeout_s)
        if error is not None:
            raise error

    async def replace(self, subject: str, record: Record) -> None:
        """Publish `record` on a subject whose stream keeps one message a subject (MEMORY), erasing
        the one it replaces first: the stream's limit would remove it without overwriting its bytes."""
        await self.erase_last(subject)
        await self.publish(subject, record)

    async def erase_last(self, subject: str) -> bool:
        """Erase (overwrite, then delete) the newest message of `subject`; whether there was one."""
        stream = await self.js.find_stream_name_by_subject(subject)
        try:
            await self.js.delete_msg(stream, (await self.js.get_last_msg(stream, subject)).seq)  # nats-py erases
        except NotFoundError:
            return False
        return True

    async def publish_all(
        self, subject: str, records: list[Record], timeout_s: float = 10.0
    ) -> list[BaseException | None]:
        """Publish records pipelined: send them all, then wait for JetStream's acks together
        (one round trip and no task per record). Per record: None once it is durable, else the
        error (`TimeoutError`, ...)."""
        kind = carried_by(subject)
        for record in records:
            if not isinstance(record, kind):
                raise TypeError(f"{subject} carries {kind.__name__}, not {type(record).__name__}")
        sent: list[asyncio.Future | BaseException] = []
        for record in records:
            try:
                sent.append(await self._send(subject, record))
            except Exception as exc:
                sent.append(exc)
        futures = [f for f in sent if isinstance(f, asyncio.Future)]
        if futures:
            await asyncio.wait(futures, timeout=timeout_s)
        return [_outcome(item, timeout_s) for item in sent]

    async def _send(self, subject: str, record: Record) -> asyncio.Future:
        payload = encode(record)
        headers = {"Nats-Msg-Id": record.id}
        ttl = self.retention.get(tenant_of(record)) if self.retention else None
        if ttl is not None:
            headers["Nats-TTL"] = f"{max(1, int(ttl))}s"
        if len(payload) > self.nc.max_payload - HEADROOM:
            headers[HEADER] = await self.large.put(subject, record.id, payload, ttl)
            payload = b""
        return await self._acks.send(subject, payload, headers=headers)

    async def resolve(self, sample: Sample) -> bool:
        """Attach the trajectory a sample refers to (nothing to do if it carries one). False if
        the TRAJECTORIES stream no longer holds it (past its retention) or holds something else
        at that sequence."""
        if sample.trajectory is not None:
            return True
        try:
            raw = await self.get_message(TRAJECTORIES.name, sample.trajectory_seq)
            trajectory = decode(await read_payload(self, raw.data, raw.headers), Trajectory)
        except (NotFoundError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.error("sample %s: no trajectory at TRAJECTORIES #%s (%s)", sample.id, sample.trajectory_seq, exc)
            return False
        if trajectory.id != sample.id:
            log.error("sample %s: TRAJECTORIES #%s holds %s", sample.id, sample.trajectory_seq, trajectory.id)
            return False
        sample.trajectory = trajectory
        return True

    async def get_message(self, stream: str, seq: int) -> Any:
        """A stream's message by sequence number. A direct get first (any replica answers it:
        cheap, and it spreads reads); then through the stream's leader if that found nothing,
        failed or was not answered, because a replica that is behind, or just restarted, does not
        hold the newest messages yet (it answers 404, or 408). `NotFoundError` when the stream
        does not hold it."""
        try:
            return await self.js.get_msg(stream, seq, direct=True)
        except (APIError, nats.errors.TimeoutError):
            return await self.js.get_msg(stream, seq)

    def consumer(
        self, subject: str, durable: str, ack_wait_s: float = 30.0, max_ack_pending: int = 100_000
    ) -> Consumer:
        return Consumer(self, subject, durable, ack_wait_s, max_ack_pending)

    async def last(self, subject: str) -> Record | None:
        """The newest record on a subject, or None if there is none."""
        stream = await self.js.find_stream_name_by_subject(subject)
        try:
            raw = await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        return decode(await read_payload(self, raw.data, raw.headers), carried_by(subject))

    async def recent(self, subject: str, window: int) -> AsyncIterator[tuple[int, Record]]:
        """The records on `subject` among the last `window` messages its stream held when called,
        oldest first, each with its stream sequence: one direct get per record, the next one on
        the subject (the stream's other subjects are skipped by the server). For a sample of
        recent history; a record that does not decode is logged and skipped."""
        stream = await self.js.find_stream_name_by_subject(subject)
        last = await self.last_seq(stream)
        seq, kind = max(1, last - window + 1), carried_by(subject)
        while seq <= last:
            try:
                raw = await self.js.get_msg(stream, seq, subject=subject, next=True, direct=True)
            except NotFoundError:
                return
            if raw.seq > last:
                return
            seq = raw.seq + 1
            try:
                yield raw.seq, decode(await read_payload(self, raw.data, raw.headers), kind)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.error("ignoring malformed %s record at %s #%d: %s", kind.__name__, stream, raw.seq, exc)

    async def last_seq(self, stream: str) -> int:
        """The stream's last sequence now (0: empty): to follow it later from here (`after_seq`)."""
        return (await self.js.stream_info(stream)).state.last_seq

    async def follow(self, subject: str, from_last: bool = True, newest_only: bool = False,
                     from_first: bool = False, after_seq: int | None = None,
                     on_seq: Callable[[int], None] | None = None) -> AsyncIterator[Record]:
        """Every new record on a subject (starting with the newest existing one if `from_last`,
        with every one the stream holds if `from_first`, with those after stream sequence
        `after_seq` if given: what a scan of the stream did not read), through an ephemeral
        ordered consumer: for state every process must see, like weights. `newest_only`: of
        records that arrived together (a backlog after the bus was away, or while the caller was
        busy) only the newest, for state where it supersedes the rest. `on_seq` is given each
        record's stream sequence once the caller has taken it (asked for the next): where to
        follow again from after a fault, the record the caller failed on included."""
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        policy = DeliverPolicy.ALL if from_first else DeliverPolicy.LAST if from_last else DeliverPolicy.NEW
        config = None
        if after_seq is not None:
            policy, config = None, ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after_seq + 1)
        sub = await self.js.subscribe(subject, cb=queue.put, ordered_consumer=True, deliver_policy=policy, config=config)
        kind = carried_by(subject)
        try:
            while True:
                msg = await queue.get()
                while newest_only and not queue.empty():
                    msg = queue.get_nowait()
                try:
                    yield decode(await read_payload(self, msg.data, msg.headers), kind)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    log.error("ignoring malformed %s record: %s", kind.__name__, exc)
                if on_seq is not None:
                    on_seq(msg.metadata.sequence.stream)
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
