"""Tenants changed at run time: the records the admin API writes on the bus.

A `TenantEntry` overlays a tenant of the configuration (or adds one): its consent settings and its
keys, each key known only by its SHA-256 digest (the admin API hands a new key out once and keeps
only its digest); a revoked key stays listed, revoked, so that a key of the configuration can be
revoked too (every administrative action is also on the audit log: `AuditEntry`,
flywheel/bus/records.py).
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec


class KeyEntry(msgspec.Struct, kw_only=True):
    id: str
    """The first 12 hex digits of the key's SHA-256: how the admin API names it."""
    digest: str
    """The key's SHA-256, in hex."""
    training: Literal["opt_in", "opt_out", "off"] | None = None
    store: bool = True
    revoked: bool = False
    created_at: float = msgspec.field(default_factory=time.time)


class TenantEntry(msgspec.Struct, kw_only=True):
    name: str
    training: Literal["opt_in", "opt_out", "off"] = "opt_in"
    store: bool = True
    pii: Literal["off", "drop", "redact_input"] = "drop"
    keys: list[KeyEntry] = msgspec.field(default_factory=list)
    updated_at: float = msgspec.field(default_factory=time.time)
    forgotten_at: float | None = None
    """When the tenant was forgotten: its keys are all revoked, its settings stay (the
    configuration's tenant must not start training or keeping again), and its name is free for a
    new tenant of that name, who starts with those keys revoked."""
