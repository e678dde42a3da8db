"""Reading every record a stream holds, oldest first: for the operations that must see all of it
(`flywheel forget` removing a tenant's records, `--retrain` replaying the samples that remain, a
judge or gateway taking the forgets and the people's instructions before it starts: `take_all`).

One request per message, each for the next one the stream holds from a sequence on: what was
deleted, expired or replaced in between (MEMORY keeps each person's newest record only) costs
nothing. A message that cannot be read (another schema, a large record whose body is gone) is
logged and passed over: the scan is not the place to judge it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.js.errors import NotFoundError

from flywheel.bus.large import read_payload
from flywheel.bus.records import Record, decode
from flywheel.bus.streams import record_type

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    seq: int
    headers: dict[str, str] | None
    record: Record


async def stored_records(bus: Any, stream: str) -> AsyncIterator[Stored]:
    """Every readable record `stream` holds now, in order (nothing if the stream does not exist)."""
    try:
        info = await bus.js.stream_info(stream)
    except NotFoundError:
        return
    if not info.state.messages:
        return
    seq, last = info.state.first_seq, info.state.last_seq
    while seq <= last:
        try:  # the next message from `seq` on, from the stream's leader (a replica may lag: `Bus.get_message`)
            message = await bus.js.get_msg(stream, seq, subject=">", next=True)
        except NotFoundError:
            return
        if message.seq > last:
            return
        seq = message.seq + 1
        kind = record_type(message.subject)
        if kind is None:
            continue
        try:
            record = decode(await read_payload(bus, message.data, message.headers), kind)
        except (msgspec.ValidationError, msgspec.DecodeError, NotFoundError) as exc:
            log.warning("%s #%d cannot be read (%s); passed over", stream, message.seq, exc)
            continue
        yield Stored(message.seq, message.headers, record)


async def take_all(bus: Any, stream: str, take: Callable[[Record], Any]) -> int:
    """Hand every readable record `stream` holds now to `take`, in order; the last sequence read
    (0: none), to follow the stream from (`Bus.follow(after_seq=...)`): state a process must
    have whole before it starts work, and then keep up with."""
    last = 0
    async for stored in stored_records(bus, stream):
        take(stored.record)
        last = stored.seq
    return last
