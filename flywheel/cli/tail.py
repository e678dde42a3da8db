"""`flywheel tail NAME`: print the records of a stream or subject as JSON lines.

NAME is a stream (`TRAFFIC`, `SAMPLES`, ...), a subject (`flywheel.samples`) or a short alias
(`turns`, `events`, `trajectories`, `samples`, `weights`, `audit`). Prints what the stream holds and
exits; `--follow` keeps printing new records. The bus is found as the other subcommands find it:
`bus.url`, else the `bus.url` file a running deployment writes into its `run_dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import msgspec
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from flywheel.bus.client import Bus
from flywheel.bus.large import read_payload
from flywheel.bus.records import decode, encode
from flywheel.bus.streams import (
    AUDIT_SUBJECT,
    SAMPLE_SUBJECT,
    SESSION_EVENT_SUBJECT,
    STREAMS,
    TRAJECTORY_SUBJECT,
    TURN_SUBJECT,
    WEIGHTS_SUBJECT,
    record_type,
)
from flywheel.cli.arguments import add_config, bus_url, load

ALIASES = {
    "turns": TURN_SUBJECT,
    "events": SESSION_EVENT_SUBJECT,
    "trajectories": TRAJECTORY_SUBJECT,
    "samples": SAMPLE_SUBJECT,
    "weights": WEIGHTS_SUBJECT,
    "audit": AUDIT_SUBJECT,
}


def resolve_subject(name: str) -> str:
    """A subject filter for NAME; raises ValueError naming the accepted forms."""
    if name in ALIASES:
        return ALIASES[name]
    if name.upper() in STREAMS:
        return STREAMS[name.upper()].subjects[0]
    if name.startswith("flywheel."):
        return name
    accepted = ", ".join([*ALIASES, *STREAMS])
    raise ValueError(f"unknown stream or subject {name!r}; accepted: {accepted}, or a flywheel.* subject")


async def _as_json(bus: Bus, msg: Any) -> str:
    """A message as one JSON line: the record re-encoded, or what is wrong with it."""
    kind = record_type(msg.subject)
    try:
        if kind is None:
            raise msgspec.ValidationError(f"no record type is defined for {msg.subject}")
        return encode(decode(await read_payload(bus, msg.data, msg.headers), kind), "json").decode()
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return json.dumps({"subject": msg.subject, "malformed": str(exc)})


async def _holds_any(bus: Bus, stream: str, subject: str) -> bool:
    """Whether `stream` holds a record on `subject`: one request, however many subjects it matches
    (MEMORY has one a person)."""
    try:
        await bus.js.get_msg(stream, 0, subject=subject, next=True)
    except NotFoundError:
        return False
    return True


async def tail(url: str, subject: str, follow: bool, limit: int | None, out=sys.stdout) -> int:
    """Write records on `subject` to `out`, one JSON object per line; returns how many."""
    bus = await Bus.connect(url, name="flywheel.cli.tail", ensure_streams=False)
    stream = await bus.js.find_stream_name_by_subject(subject)
    if not follow and not await _holds_any(bus, stream, subject):
        await bus.close()
        return 0
    queue: asyncio.Queue = asyncio.Queue()
    sub = await bus.js.subscribe(
        subject, cb=queue.put, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    count = 0
    try:
        while limit is None or count < limit:
            msg = await queue.get()
            out.write(await _as_json(bus, msg) + "\n")
            out.flush()
            count += 1
            if not follow and msg.metadata.num_pending == 0:
                break
        return count
    finally:
        await sub.unsubscribe()
        await bus.close()


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = " ".join(__doc__.split("\n\n")).replace("\n", " ").split(": ", 1)[1]
    parser.add_argument("name", help="stream, subject or alias: " + ", ".join(ALIASES))
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new records")
    parser.add_argument("-n", "--limit", type=int, default=None, help="stop after this many records")
    add_config(parser)
    parser.set_defaults(run=main, parser=parser)


def main(args: argparse.Namespace) -> int:
    try:
        subject = resolve_subject(args.name)
    except ValueError as exc:
        args.parser.error(str(exc))
    try:
        asyncio.run(tail(bus_url(load(args)), subject, args.follow, args.limit))
    except BrokenPipeError:  # e.g. piped into `head`
        pass
    return 0
