"""Who is calling: a request's key resolved to its tenant and what the key may do, and a client's
session id to the session it names on the bus.

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
from flywheel.config.tenants import OPEN_TENANT, Training, stricter


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class Grant:
    """What a key may do: whose requests it sends, and their consent to train and to be kept."""

    tenant: str
    training: Training
    store: bool


OPEN = Grant(OPEN_TENANT, "opt_out", True)
"""A deployment with no keys: one operator training on its own traffic, as before tenants."""


@dataclass(frozen=True)
class TenantDirectory:
    grants: dict[bytes, Grant]
    """SHA-256 of each client key -> its grant; empty: the one open tenant, no key needed."""

    @staticmethod
    def key_tenant(key: str) -> str:
        """The tenant a key is when no `tenants:` section names it: `key-` and the first 12 hex
        digits of its SHA-256 (on records and in metrics; the key itself is never written)."""
        return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]

    @classmethod
    def from_config(cls, config: FlywheelConfig) -> TenantDirectory:
        """The tenants of `config`, keys given by `env` read from this process's environment (a
        ConfigError naming the variable that is not set). Keys in `serve.api_keys` are tenants of
        their own that train unless a request says not to (the operator's own clients, as before
        tenants); a `tenants:` entry's training defaults to `opt_in`."""
        grants: dict[str, Grant] = {key: Grant(cls.key_tenant(key), "opt_out", True) for key in config.serve.api_keys}
        for name, tenant in config.tenants.items():
            for key in tenant.keys:
                value = key.value
                if key.env is not None:
                    value = os.environ.get(key.env)
                    if not value:
                        raise ConfigError(f"tenants.{name}.keys: {key.env} is not set")
                grant = Grant(name, stricter(tenant.training, key.training), tenant.store and key.store)
                if grants.setdefault(value, grant).tenant != name:
                    raise ConfigError(f"tenants.{name}.keys: {key.env} holds a key of tenant {grants[value].tenant} too")
        return cls({_digest(key.encode()): grant for key, grant in grants.items()})

    @property
    def open(self) -> bool:
        """No keys: every request is the open tenant's."""
        return not self.grants

    def grant_of(self, key: bytes | None) -> Grant | None:
        """What `key` may do; None for no key or an unknown one (the open grant when there are
        no keys)."""
        if self.open:
            return OPEN
        return self.grants.get(_digest(key)) if key else None

    def session(self, tenant: str, client_id: str) -> str:
        """The session a tenant's client id names on the bus."""
        return client_id if self.open else f"{tenant}/{client_id}"
