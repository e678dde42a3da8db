"""The sessions the gateways have opened, kept on the bus: a session exists once a request of it
arrived, and only under the id its tenant gave it (`TenantDirectory.session`).

Feedback and ends name a session; one that was never opened (another tenant's id included:
namespaced, it is not this tenant's) answers 404, exactly as one that never existed. Every
gateway writes and reads the same JetStream key-value bucket, `FLYWHEEL_SESSIONS`, so feedback
may reach any gateway; each remembers the sessions it has written (an LRU) and writes one again
only once an hour, so a session costs one write per gateway per hour, not one per turn. Whether
one exists is asked of the bus (feedback is rare), so a forgotten session is gone at once. Keys
are the SHA-256 of the session id (ids are any string; keys must be subject-safe); values name
the tenant. Entries expire with the bucket's age limit, as the session's records do.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

from nats.errors import Error as NatsError
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from flywheel.lru import LRU

BUCKET = "FLYWHEEL_SESSIONS"
REFRESH_S = 3600.0
"""A session this gateway wrote is written again after this long (its entry's age restarts)."""
WAIT_S = 0.5
"""The longest a request waits for its session to be written (a bus losing a member can take
seconds to take a write; the request goes on, and the write in the background)."""

log = logging.getLogger(__name__)


class SessionUnknown(Exception):
    """Whether the session exists cannot be told now (the bus is unreachable)."""


def session_key(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()[:40]


class SessionRegistry:
    def __init__(self, kv: Any, remember: int = 100_000):
        self._kv = kv
        self._written: LRU[str, float] = LRU(remember)
        self._unwritten: LRU[str, str] = LRU(remember)
        """Sessions not written yet (id -> tenant): the bus was slow or unreachable."""
        self._writing: asyncio.Task | None = None

    @classmethod
    async def open(cls, bus: Any, max_age_s: float) -> SessionRegistry:
        """The registry on `bus`, its bucket created (entries kept `max_age_s`) by the first to use it."""
        try:
            kv = await bus.js.key_value(BUCKET)
        except BucketNotFoundError:
            config = KeyValueConfig(bucket=BUCKET, history=1, ttl=max_age_s, storage=StorageType.FILE,
                                    replicas=bus.replicas, description="The sessions Flywheel's gateways opened")
            kv = await bus.js.create_key_value(config)
        return cls(kv)

    async def opened(self, session_id: str, tenant: str) -> None:
        """Record that `session_id` (namespaced) exists, waiting at most `WAIT_S` for the bus.
        Never fails a request: a write the bus does not take in time goes on in the background,
        and one that fails is retried with the next session opened; meanwhile the session is
        known to this gateway."""
        now = time.monotonic()
        written = self._written.get(session_id)
        if written is not None and now - written < REFRESH_S:
            return
        self._written[session_id] = now
        self._unwritten[session_id] = tenant
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._write())
        try:
            await asyncio.wait_for(asyncio.shield(self._writing), WAIT_S)
        except TimeoutError:
            log.warning("the bus took more than %.1fs to record session %s; writing it in the background", WAIT_S, session_id)

    async def _write(self) -> None:
        """Write every session not written yet, until none is left or the bus refuses one."""
        try:
            while len(self._unwritten):
                session_id = next(iter(self._unwritten))
                await self._kv.put(session_key(session_id), self._unwritten.peek(session_id).encode())
                self._unwritten.pop(session_id)
        except (NatsError, TimeoutError, OSError) as exc:
            log.warning("could not record %d session(s) on the bus (%s); known to this gateway, written with the next "
                        "session", len(self._unwritten), exc)

    async def exists(self, session_id: str) -> bool:
        """Whether a request of `session_id` (namespaced) arrived at any gateway, and it was not
        forgotten since: the bus says, and this gateway's own memory only for a session it has
        not written yet, or while the bus cannot answer (else SessionUnknown)."""
        try:
            await self._kv.get(session_key(session_id))
        except KeyNotFoundError:
            return session_id in self._unwritten
        except (NatsError, TimeoutError, OSError) as exc:
            if session_id in self._written:
                return True
            raise SessionUnknown(str(exc)) from None
        return True
