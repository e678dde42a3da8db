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
from flywheel.tenants.records import TenantEntry


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class Grant:
    """What a key may do: whose requests it sends, and their consent to train and to be kept."""

    tenant: str
    training: Training
    store: bool
    pii: str = "off"
    """The tenant's personal-data policy: `off`, `drop` or `redact_input`."""
    pii_entities: tuple[str, ...] | None = None
    """The types its policy looks for (None: the default set)."""


OPEN = Grant(OPEN_TENANT, "opt_out", True)
"""A deployment with no keys: one operator training on its own traffic, as before tenants."""


@dataclass(frozen=True)
class _Key:
    """A key's own part of its grant: its tenant, and what the key narrows."""

    tenant: str
    training: Training | None = None
    store: bool = True


class TenantDirectory:
    """The tenants and keys of the configuration, overlaid by those changed at run time
    (`apply`, from the bus: flywheel/tenants/registry.py)."""

    def __init__(self, keys: dict[bytes, _Key], settings: dict[str, tuple[Training, bool]],
                 privacy: dict[str, tuple[str, tuple[str, ...] | None]] | None = None):
        self._base_keys, self._base_settings = keys, settings
        self._base_privacy = privacy or {}
        self._entries: dict[str, TenantEntry] = {}
        self.grants: dict[bytes, Grant] = {}
        """SHA-256 of each client key -> its grant; empty: the one open tenant, no key needed."""
        self._rebuild()

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
        keys = {_digest(key.encode()): _Key(cls.key_tenant(key)) for key in config.serve.api_keys}
        settings: dict[str, tuple[Training, bool]] = {key.tenant: ("opt_out", True) for key in keys.values()}
        privacy: dict[str, tuple[str, tuple[str, ...] | None]] = {}
        for name, tenant in config.tenants.items():
            settings[name] = (tenant.training, tenant.store)
            privacy[name] = (tenant.pii, tuple(tenant.pii_entities) if tenant.pii_entities is not None else None)
            for key in tenant.keys:
                value = key.value
                if key.env is not None:
                    value = os.environ.get(key.env)
                    if not value:
                        raise ConfigError(f"tenants.{name}.keys: {key.env} is not set")
                if keys.setdefault(_digest(value.encode()), _Key(name, key.training, key.store)).tenant != name:
                    raise ConfigError(f"tenants.{name}.keys: {key.env} holds a key of another tenant too")
        return cls(keys, settings, privacy)

    def apply(self, entry: TenantEntry) -> None:
        """A tenant added or changed at run time: its settings and keys now hold, a revoked key
        (of the configuration too) no longer opens anything."""
        self._entries[entry.name] = entry
        self._rebuild()

    def _rebuild(self) -> None:
        settings = dict(self._base_settings)
        privacy = dict(self._base_privacy)
        keys = dict(self._base_keys)
        for entry in self._entries.values():
            settings[entry.name] = (entry.training, entry.store)
            privacy[entry.name] = (entry.pii, privacy.get(entry.name, ("off", None))[1])
            for key in entry.keys:
                digest = bytes.fromhex(key.digest)
                if key.revoked:
                    keys.pop(digest, None)
                else:
                    keys[digest] = _Key(entry.name, key.training, key.store)
        self.grants = {digest: Grant(key.tenant, stricter(settings[key.tenant][0], key.training),
                                     settings[key.tenant][1] and key.store, *privacy.get(key.tenant, ("off", None)))
                       for digest, key in keys.items()}
        self._privacy = privacy

    def configured(self, name: str) -> bool:
        """Whether `name` is a tenant of the configuration (whatever became of its keys since)."""
        return name in self._base_settings

    def privacy_of(self, tenant: str) -> tuple[str, tuple[str, ...] | None]:
        """A tenant's personal-data policy and the types it looks for (`Grant.pii`, `pii_entities`)."""
        return self._privacy.get(tenant, ("off", None))

    def tenants(self) -> dict[str, dict]:
        """Every tenant and its keys (by id), as the admin API shows them."""
        out: dict[str, dict] = {}
        for digest, grant in self.grants.items():
            tenant = out.setdefault(grant.tenant, {"training": None, "store": None, "pii": grant.pii, "keys": []})
            tenant["keys"].append({"id": digest.hex()[:12], "training": grant.training, "store": grant.store})
        for name in out:
            entry = self._entries.get(name)
            out[name]["training"], out[name]["store"] = (entry.training, entry.store) if entry else self._base_settings[name]
        return out

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
