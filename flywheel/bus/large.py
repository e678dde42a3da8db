"""Records larger than one NATS message, carried whole through the JetStream object store.

NATS caps a message (`max_payload`, 1 MiB by default), and a long agent session's turn (100k+
prompt ids with their text) or its trajectory is larger. Such a record is put in the object
store bucket `FLYWHEEL_LARGE` (chunked, with a digest) under its subject and id, and its stream
gets a message with no body and the header `Flywheel-Large: <object name>`. The record keeps its
place in its stream's order, its `Nats-Msg-Id` deduplication and its acknowledgements; readers
(`read_payload`) fetch the body back. The object is written (and acknowledged) before the
message that refers to it, so a reader never sees a reference to nothing. Objects are kept as
long as the streams keep records, or, for a tenant with its own `retention_days`, until its
expiry (the `Flywheel-Expires` header the object is written with, the same age as its message's
`Nats-TTL`): the object store has no per-object age, so `sweep` deletes the expired ones, and the
collector sweeps every minute.
"""

from __future__ import annotations

import time
from typing import Any

from nats.js.api import ObjectMeta, ObjectStoreConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError

BUCKET = "FLYWHEEL_LARGE"
HEADER = "Flywheel-Large"
EXPIRES = "Flywheel-Expires"
"""An object's expiry (seconds since the epoch), when its record's tenant keeps records less long."""
HEADROOM = 4096
"""Bytes of a message left for headers and protocol: a body above max_payload − this is large."""
KEEP_S = 30 * 24 * 3600.0
"""As long as the longest-kept stream (`flywheel.bus.streams`)."""


class LargeRecords:
    def __init__(self, js: Any, replicas: int = 1):
        self._js = js
        self._replicas = replicas
        self._store: Any = None

    async def _bucket(self) -> Any:
        if self._store is None:
            try:
                self._store = await self._js.object_store(BUCKET)
            except BucketNotFoundError:
                config = ObjectStoreConfig(ttl=KEEP_S, storage=StorageType.FILE, description="Flywheel records over max_payload",
                                           replicas=self._replicas)
                self._store = await self._js.create_object_store(BUCKET, config=config)
        return self._store

    async def put(self, subject: str, record_id: str, payload: bytes, ttl_s: float | None = None) -> str:
        """Store a record's encoding, to expire after `ttl_s` if given; returns the object's name
        (the header's value)."""
        name = f"{subject}/{record_id}"
        expires = {EXPIRES: f"{time.time() + ttl_s:.3f}"} if ttl_s is not None else None
        await (await self._bucket()).put(name, payload, meta=ObjectMeta(name=name, headers=expires))
        return name

    async def sweep(self) -> int:
        """Delete the objects past their expiry; how many went."""
        bucket = await self._bucket()
        try:
            objects = await bucket.list(ignore_deletes=True)
        except NotFoundError:
            return 0
        now = time.time()
        expired = [o.name for o in objects if o.headers and EXPIRES in o.headers and float(o.headers[EXPIRES]) <= now]
        for name in expired:
            await bucket.delete(name)
        return len(expired)

    async def get(self, name: str) -> bytes:
        return (await (await self._bucket()).get(name)).data


def is_large(headers: dict[str, str] | None) -> bool:
    return bool(headers) and HEADER in headers


async def read_payload(bus: Any, data: bytes, headers: dict[str, str] | None) -> bytes:
    """A message's record bytes: its body, or the object its header names."""
    if not is_large(headers):
        return data
    return await bus.large.get(headers[HEADER])
