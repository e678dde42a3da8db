"""Who is calling: a request's key resolved to its tenant, and a client's session id to the
session it names on the bus.

Keys are held as SHA-256 digests (the directory never keeps a key it was given), and a key is
looked up by its digest, so no comparison leaks how much of a key was right. Session ids are
namespaced per tenant: `acme/conversation-42` is tenant acme's `conversation-42`, and another
tenant's request with the same `X-Session-Id` names another session; what a caller may not see
answers exactly as what does not exist. The one open tenant of a deployment with no keys keeps
its clients' ids as sent.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from flywheel.config import ConfigError, FlywheelConfig
from flywheel.config.tenants import OPEN_TENANT


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class TenantDirectory:
    tenant_by_digest: dict[bytes, str]
    """SHA-256 of each client key -> its tenant; empty: the one open tenant, no key needed."""

    @staticmethod
    def key_tenant(key: str) -> str:
        """The tenant a key is when no `tenants:` section names it: `key-` and the first 12 hex
        digits of its SHA-256 (on records and in metrics; the key itself is never written)."""
        return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]

    @classmethod
    def from_config(cls, config: FlywheelConfig) -> TenantDirectory:
        """The tenants of `config`, their `key_envs` read from this process's environment
        (a ConfigError naming the variable that is not set)."""
        keys: dict[str, str] = {key: cls.key_tenant(key) for key in config.serve.api_keys}
        for name, tenant in config.tenants.items():
            for variable in tenant.key_envs:
                if not os.environ.get(variable):
                    raise ConfigError(f"tenants.{name}.key_envs: {variable} is not set")
            for key in [*tenant.keys, *(os.environ[variable] for variable in tenant.key_envs)]:
                if keys.setdefault(key, name) != name:
                    raise ConfigError(f"tenants.{name}.key_envs: a key of tenant {keys[key]} too")
        return cls({_digest(key.encode()): name for key, name in keys.items()})

    @property
    def open(self) -> bool:
        """No keys: every request is the open tenant's."""
        return not self.tenant_by_digest

    def tenant_of(self, key: bytes | None) -> str | None:
        """The tenant holding `key`; None for no key or an unknown one (the open tenant when
        there are no keys)."""
        if self.open:
            return OPEN_TENANT
        return self.tenant_by_digest.get(_digest(key)) if key else None

    def session(self, tenant: str, client_id: str) -> str:
        """The session a tenant's client id names on the bus."""
        return client_id if self.open else f"{tenant}/{client_id}"
