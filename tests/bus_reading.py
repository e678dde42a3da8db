"""Reading the bus in tests: what a consumer delivers (`delivered`, `read`), what the gateway
recorded (`traffic_records`, `session_events`, `recorded_turns`), what the collector and the judge
made of it (`collected`, `judged`, `counted`), and every message of every stream
(`everything_on_the_bus`, `stream_names`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from flywheel.bus import (
    SAMPLE_SUBJECT,
    TRAFFIC_SUBJECTS,
    TRAJECTORY_SUBJECT,
    UNSCORED_SUBJECT,
    SessionEvent,
    Trajectory,
    Turn,
)

from waiting import DEFAULT_TIMEOUT_S, until


async def delivered(consumer, n: int = 1, keep: Callable[[Any], bool] = lambda record: True,
                    timeout_s: float = DEFAULT_TIMEOUT_S, fetch_s: float = 1.0) -> list:
    """The deliveries `consumer` fetches whose record `keep` accepts, once there are at least
    `n` of them (the others are passed over); fails the test if there are not within `timeout_s`."""
    got: list = []
    if n <= 0:
        return got

    async def enough() -> bool:
        got.extend(d for d in await consumer.fetch(timeout_s=fetch_s) if keep(d.record))
        return len(got) >= n

    await until(enough, timeout_s)
    return got


async def read(bus, subject: str, durable: str, n: int = 1, keep: Callable[[Any], bool] = lambda record: True,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """At least `n` records on `subject` that `keep` accepts, read from the start by the durable
    consumer `durable` (again under the same name: from where the last read stopped)."""
    return [d.record for d in await delivered(bus.consumer(subject, durable), n, keep, timeout_s)]


async def traffic_records(bus, n: int, durable: str = "check") -> list:
    """What the gateway recorded (turns, feedback, ends), without its announcements of requests in flight."""
    return await read(bus, TRAFFIC_SUBJECTS, durable, n, lambda r: getattr(r, "kind", None) != "pending")


async def session_events(bus, n: int, durable: str = "events-check") -> list[SessionEvent]:
    """The first `n` feedback and end events the gateway recorded (at least)."""
    return await read(bus, TRAFFIC_SUBJECTS, durable, n, lambda r: isinstance(r, SessionEvent) and r.kind != "pending")


async def recorded_turns(bus, n: int = 1, durable: str = "turns-check") -> list[Turn]:
    """The first `n` turns the gateway recorded (at least)."""
    return await read(bus, TRAFFIC_SUBJECTS, durable, n, lambda r: isinstance(r, Turn))


async def collected(bus, n_sessions: int, n_turns: int) -> tuple[dict[str, Trajectory], dict[str, list[Turn]]]:
    """The collector's first `n_sessions` trajectories by session, and the first `n_turns`
    recorded turns by session in turn order."""
    trajectories = await read(bus, TRAJECTORY_SUBJECT, "live-trajectories", n_sessions, lambda r: isinstance(r, Trajectory))
    turns: dict[str, list[Turn]] = {}
    for turn in await read(bus, TRAFFIC_SUBJECTS, "live-turns", n_turns, lambda r: isinstance(r, Turn)):
        turns.setdefault(turn.session_id, []).append(turn)
    return {t.session_id: t for t in trajectories}, {s: sorted(ts, key=lambda t: t.turn_index) for s, ts in turns.items()}


async def judged(bus, n: int, durable: str = "check", timeout_s: float = 60) -> dict[str, object]:
    """The first n records on SAMPLES and UNSCORED together, by trajectory id (each acknowledged;
    one judged twice fails the test)."""
    consumers = bus.consumer(SAMPLE_SUBJECT, durable), bus.consumer(UNSCORED_SUBJECT, durable)
    out: dict[str, object] = {}

    async def enough() -> bool:
        for consumer in consumers:
            for delivery in await consumer.fetch(timeout_s=0.1):
                assert delivery.record.id not in out, f"{delivery.record.id} judged twice"
                out[delivery.record.id] = delivery.record
                await delivery.ack()
        return len(out) >= n

    await until(enough, timeout_s)
    return out


async def counted(loop, n: int) -> dict:
    """A judge loop's stats once it has counted `n` judgements: it counts one after publishing its
    record and acknowledging the trajectory, so the count can lag the record a reader sees."""
    await until(lambda: loop.stats()["scored"] + loop.stats()["unscored"] >= n)
    return loop.stats()


async def everything_on_the_bus(bus) -> bytes:
    """Every message of every stream (key-value buckets and the object store are streams too)."""
    blob = []
    async for name in stream_names(bus):
        info = await bus.js.stream_info(name)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                message = await bus.js.get_msg(name, seq)
            except Exception:  # a gap: deleted or expired
                continue
            blob.append(name.encode() + b" " + message.subject.encode() + b" " + (message.data or b"")
                        + msgspec.json.encode(message.headers or {}))
    return b"\n".join(blob)


async def stream_names(bus):
    """The names of every stream on the bus."""
    for info in await bus.js.streams_info():
        yield info.config.name
