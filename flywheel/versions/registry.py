"""The version registry, kept on the bus: a JetStream key-value bucket any component can read.

Keys of the bucket `FLYWHEEL_VERSIONS` (records in `flywheel/versions/records.py`, MessagePack):

    v.<N>      the `VersionEntry` of version N
    a.<A>.v.<N>  the `VersionEntry` of version N of the shared or tenant adapter A
    routing    the `Routing` gateways follow (which version serves, which one is canary, each adapter's)
    trainer    the latest `TrainerDirective` (what to continue from after a rollback)
    trainer.a.<A>  the latest `TrainerDirective` about adapter A's line
    result.<id>  the `CommandResult` of an operator's command (what `flywheel versions` waits for)

The bucket is a stream like the others (replicated as `bus.replicas` says, kept on disk), so the
registry outlives every process, the promotion loop included: a promoter that restarts reads
where every version stands and goes on. Each key keeps its last 16 values (`kv history`), so a
routing change can be traced. Gateways follow `routing` through the bucket's subject
(`flywheel.bus.streams.ROUTING_SUBJECT`, with `Bus.follow`), the way they follow weight announcements.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from flywheel.bus.records import decode, encode
from flywheel.bus.streams import COMMANDS_SUBJECT, REGISTRY_BUCKET
from flywheel.versions.records import (
    CommandKind,
    CommandResult,
    Routing,
    TrainerDirective,
    VersionCommand,
    VersionEntry,
)

BUCKET = REGISTRY_BUCKET
ROUTING_KEY = "routing"
TRAINER_KEY = "trainer"
HISTORY = 16


def version_key(version: int, adapter: str | None = None) -> str:
    return f"v.{version}" if adapter is None else f"a.{adapter}.v.{version}"


def directive_key(adapter: str | None = None) -> str:
    return TRAINER_KEY if adapter is None else f"{TRAINER_KEY}.a.{adapter}"


class Registry:
    def __init__(self, kv: Any, js: Any):
        self._kv, self._js = kv, js

    @classmethod
    async def open(cls, bus: Any) -> "Registry":
        """The registry on `bus`, its bucket created if this is the first to use it."""
        try:
            kv = await bus.js.key_value(BUCKET)
        except BucketNotFoundError:
            config = KeyValueConfig(bucket=BUCKET, history=HISTORY, storage=StorageType.FILE, replicas=bus.replicas,
                                    description="Flywheel's policy versions, their states and the routing")
            kv = await bus.js.create_key_value(config)
        return cls(kv, bus.js)

    async def _get(self, key: str, kind: type) -> Any:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return decode(entry.value, kind)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None

    async def get(self, version: int, adapter: str | None = None) -> VersionEntry | None:
        return await self._get(version_key(version, adapter), VersionEntry)

    async def put(self, entry: VersionEntry) -> None:
        await self._kv.put(version_key(entry.version, entry.adapter), encode(entry))

    async def purge(self, entry: VersionEntry) -> None:
        """Remove `entry` and its history (a forgotten tenant's adapter's versions)."""
        await self._kv.purge(version_key(entry.version, entry.adapter))

    async def purge_directive(self, adapter: str) -> None:
        await self._kv.purge(directive_key(adapter))

    async def _keys(self, pattern: str) -> list[str]:
        """The keys matching `pattern` (NATS wildcards). They come from the bucket's stream (the
        subjects it holds), not `kv.keys()`: nats-py's key watcher can signal "no more keys"
        before it has counted entries already delivered to it, and under load `keys()` then
        returned none (tests/test_promotion.py failed so in a full suite)."""
        prefix = f"$KV.{BUCKET}."
        info = await self._js.stream_info(f"KV_{BUCKET}", subjects_filter=f"{prefix}{pattern}")
        return [subject.removeprefix(prefix) for subject in info.state.subjects or {}]

    async def versions(self, above: int = -1, adapter: str | None = None) -> list[VersionEntry]:
        """Every version of the shared weights (or of `adapter`) the registry holds, those newer
        than `above`, oldest first."""
        keys = await self._keys(version_key(0, adapter).removesuffix("0") + "*")
        entries = [await self._get(key, VersionEntry) for key in keys if int(key.rpartition(".")[2]) > above]
        return sorted((e for e in entries if e is not None), key=lambda e: e.version)

    async def adapters(self) -> list[str]:
        """The adapters with versions in the registry (a purged key keeps its subject, with a
        marker and no value: those count for none)."""
        names = sorted({key[2:].rpartition(".v.")[0] for key in await self._keys("a.>")})
        return [name for name in names if await self.versions(adapter=name)]

    async def routing(self) -> Routing | None:
        return await self._get(ROUTING_KEY, Routing)

    async def set_routing(self, routing: Routing) -> None:
        await self._kv.put(ROUTING_KEY, encode(routing))

    async def directive(self, adapter: str | None = None) -> TrainerDirective | None:
        return await self._get(directive_key(adapter), TrainerDirective)

    async def set_directive(self, directive: TrainerDirective) -> None:
        await self._kv.put(directive_key(directive.adapter), encode(directive))

    async def result(self, command_id: str) -> CommandResult | None:
        return await self._get(f"result.{command_id}", CommandResult)

    async def set_result(self, result: CommandResult) -> None:
        await self._kv.put(f"result.{result.id}", encode(result))


async def send_command(bus: Any, registry: Registry, kind: CommandKind, version: int | None = None, reason: str = "",
                       operator: str = "cli", timeout_s: float = 60.0, adapter: str | None = None) -> CommandResult:
    """Send an operator's command (on `adapter`'s line, else the shared weights') to the promotion
    loop and wait for its result; TimeoutError when no promotion loop carried it out in time (is
    `promotion.mode` on?)."""
    command = VersionCommand(id=f"command-{uuid.uuid4().hex[:12]}", kind=kind, version=version, reason=reason,
                             operator=operator, adapter=adapter)
    await bus.publish(COMMANDS_SUBJECT, command)
    deadline = time.monotonic() + timeout_s
    while (result := await registry.result(command.id)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no promotion loop carried out `{kind}` within {timeout_s:.0f} s: is promotion.mode on?")
        await asyncio.sleep(0.1)
    return result
