"""Tenants changed at run time, kept on the bus: a JetStream key-value bucket, `FLYWHEEL_TENANTS`,
one key per tenant (`t.<name>`, a `TenantEntry`), written by the admin API and followed by every
gateway; and the audit log (the AUDIT stream) every administrative action is appended to.

The bucket is a stream like the others (replicated, on disk), so a tenant or key added or revoked
through one gateway holds at every gateway, and after any restart, with no change to the
configuration file.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from flywheel.bus.records import AuditEntry, decode
from flywheel.bus.streams import AUDIT_SUBJECT
from flywheel.tenants.records import TenantEntry

BUCKET = "FLYWHEEL_TENANTS"
log = logging.getLogger(__name__)


class Changed(Exception):
    """A tenant's entry changed between reading and writing it."""


class TenantRegistry:
    def __init__(self, bus: Any, kv: Any):
        self.bus, self._kv = bus, kv

    @classmethod
    async def open(cls, bus: Any) -> TenantRegistry:
        """The registry on `bus`, its bucket created if this is the first to use it."""
        try:
            kv = await bus.js.key_value(BUCKET)
        except BucketNotFoundError:
            config = KeyValueConfig(bucket=BUCKET, history=8, storage=StorageType.FILE, replicas=bus.replicas,
                                    description="Flywheel's tenants and keys changed at run time")
            kv = await bus.js.create_key_value(config)
        return cls(bus, kv)

    async def get(self, name: str) -> TenantEntry | None:
        return (await self.read(name))[0]

    async def read(self, name: str) -> tuple[TenantEntry | None, int]:
        """The tenant's entry and its revision (0: none), to `write` back changed."""
        try:
            entry = await self._kv.get(f"t.{name}")
        except KeyNotFoundError:
            return None, 0
        return (msgspec.msgpack.decode(entry.value, type=TenantEntry) if entry.value else None), entry.revision or 0

    async def write(self, entry: TenantEntry, revision: int) -> None:
        """Write `entry` over the one read at `revision` (0: there was none); `Changed` if it was
        changed since (two admin calls, or an admin call and a forget, must not undo each other)."""
        key, value = f"t.{entry.name}", msgspec.msgpack.encode(entry)
        try:
            await (self._kv.update(key, value, last=revision) if revision else self._kv.create(key, value))
        except KeyWrongLastSequenceError:
            raise Changed(entry.name) from None

    async def current(self) -> list[TenantEntry]:
        """Every tenant entry there is now. The keys come from the bucket's stream (the subjects
        it holds), not `kv.keys()`, whose watcher can say "no more keys" too soon (see
        `Registry.versions`)."""
        prefix = f"$KV.{BUCKET}."
        info = await self.bus.js.stream_info(f"KV_{BUCKET}", subjects_filter=f"{prefix}t.>")
        names = [subject.removeprefix(f"{prefix}t.") for subject in info.state.subjects or {}]
        return [entry for entry in [await self.get(name) for name in names] if entry is not None]

    async def entries(self) -> AsyncIterator[TenantEntry]:
        """Every tenant entry there is, then every change as it is written (for ever)."""
        watcher = await self._kv.watchall()
        async for entry in watcher:
            if entry is None or not entry.value:
                continue  # the end of what the bucket held, or a deletion
            try:
                yield msgspec.msgpack.decode(entry.value, type=TenantEntry)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.error("ignoring a malformed tenant entry %s: %s", entry.key, exc)

    async def audit(self, entry: AuditEntry) -> None:
        """Append `entry` to the audit log (durable once this returns)."""
        await self.bus.publish(AUDIT_SUBJECT, entry)

    async def audit_log(self, limit: int = 1000) -> list[AuditEntry]:
        """The newest `limit` audit entries, oldest first."""
        info = await self.bus.js.stream_info("AUDIT")
        if not info.state.messages:
            return []
        first = max(info.state.first_seq, info.state.last_seq - limit + 1)
        out = []
        for seq in range(first, info.state.last_seq + 1):
            try:
                out.append(decode((await self.bus.js.get_msg("AUDIT", seq)).data, AuditEntry))
            except (NotFoundError, msgspec.ValidationError, msgspec.DecodeError) as exc:  # a gap, or unreadable
                log.debug("audit #%d skipped: %s", seq, exc)
        return out

