"""Tenants: the customers of one deployment, each with its own API keys and consent to train
(`tenants.NAME.*`).

A tenant owns its keys, its sessions and its records. Without a `tenants:` section each key in
`serve.api_keys` is a tenant of its own (two keys share data only when one tenant holds both),
and with no keys at all there is one open tenant (`open`). Part of
`flywheel.config.schema.FlywheelConfig`; the gateway's `TenantDirectory`
(flywheel/serve/ops/tenants.py) resolves a request's key to what it may do.

Consent to train, `training`: `opt_in` (a request is trained only when it says
`X-Flywheel-Train: true`), `opt_out` (trained unless it says `false`), `off` (never; a request
that asks is refused). A key may narrow its tenant's setting, never widen it: the stricter holds,
and a request's own `X-Flywheel-Train: false` or `store: false` narrows it again. `store: false`
(the tenant's, the key's, or the request's) keeps nothing beyond the request's lifetime.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from flywheel.config.section import Section
from flywheel.privacy.entities import check_entities

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
"""Lowercase letters, digits, `_` and `-`, at most 63: safe in a subject on the bus and in a path."""
RESERVED_NAMES = frozenset({"shared"})
"""Names no tenant may take: `shared` is the deployment's own adapter (`flywheel/models/adapter_names.py`),
which a tenant so named would train, be served, and delete when forgotten."""


def tenant_name_error(name: str) -> str | None:
    """Why `name` cannot be a tenant's (None: it can)."""
    if name in RESERVED_NAMES:
        return f"{name!r} is reserved (the deployment's shared adapter is named so)"
    if not TENANT_NAME.match(name):
        return f"{name!r} is not a tenant name (lowercase letters, digits, _ and -; at most 63)"
    return None

OPEN_TENANT = "open"
"""The one tenant of a deployment with no keys at all."""
def _yaml_off(value: Any) -> Any:
    """YAML reads a bare `off` as false: it means `off` here."""
    return "off" if value is False else value


Training = Annotated[Literal["opt_in", "opt_out", "off"], BeforeValidator(_yaml_off)]
STRICTNESS: dict[str, int] = {"opt_out": 0, "opt_in": 1, "off": 2}


def stricter(a: Training, b: Training | None) -> Training:
    """The stricter of two consent settings (`b` None: `a`)."""
    return a if b is None or STRICTNESS[a] >= STRICTNESS[b] else b


class KeyConfig(Section):
    """One client key of a tenant: by value or by the environment variable that holds it (read
    when a gateway starts), optionally narrower than its tenant. A plain string is a `value`."""

    value: str | None = None
    env: str | None = None
    training: Training | None = None
    """Narrows the tenant's `training` for this key's requests (the stricter of the two holds)."""
    store: bool = True
    """false: nothing of this key's requests is kept beyond the request."""

    @model_validator(mode="after")
    def _value_or_env(self) -> "KeyConfig":
        if (self.value is None) == (self.env is None):
            raise ValueError("give a key by value or by env, one of the two")
        if self.value is not None and not self.value:
            raise ValueError("a key cannot be empty")
        return self


class TenantConfig(Section):
    """A customer: its client keys and its consent to train."""

    keys: list[KeyConfig] = Field(default_factory=list)
    """Client keys (`Authorization: Bearer <key>` or `x-api-key`): `sk-...`, `{env: ACME_KEY}`,
    or `{value: sk-..., training: off}`."""
    training: Training = "opt_in"
    """Consent to train on this tenant's traffic. `opt_in` by default: a customer's traffic is
    trained on only when the customer says so (a request's `X-Flywheel-Train: true`, or
    `training: opt_out` here), as the API providers a business compares us with do."""
    store: bool = True
    """false: nothing of this tenant's traffic is kept beyond the request (served, never recorded)."""
    pii: Literal["off", "drop", "redact_input"] = "drop"
    """Personal data (flywheel/privacy/: e-mail, phone, card, IBAN, IP, national ids; not names)
    in its traffic: `drop` a turn whose prompt or reply holds some (served, never recorded or
    trained; counted), `redact_input` (the gateway replaces what it finds in the prompt's user,
    system and tool texts with placeholders such as `<EMAIL_ADDRESS>` before the model sees it,
    so the recorded tokens are exactly what the model sampled from; a reply that still holds
    some is dropped), or `off`. `drop` by default: a customer's personal data is not kept unless
    the operator decides so."""
    pii_entities: list[str] | None = None
    """The types looked for (`flywheel.privacy.SUPPORTED_ENTITIES`); null: the default set."""
    adapter_scope: Literal["shared", "tenant", "user"] | None = None
    """Whose adapter this tenant's requests use, when `adapters.kind` is `lora` (null: `adapters.scope`)."""
    memory: bool = True
    """With `memory.enabled`: false keeps no served memory for this tenant's people (nothing of
    their corrections is read for it, and no instructions are added to their requests)."""
    retention_days: float | None = Field(None, gt=0, le=7)
    """How long its records (turns, trajectories, samples, unscored) are kept on the bus, each
    from when it was written; at most 7, the streams' own age limit (null: 7; unscored: 30)."""

    @field_validator("pii_entities")
    @classmethod
    def _known_entities(cls, entities: list[str] | None) -> list[str] | None:
        return None if entities is None else list(check_entities(entities))

    @field_validator("keys", mode="before")
    @classmethod
    def _plain_keys_are_values(cls, keys: Any) -> Any:
        return [{"value": key} if isinstance(key, str) else key for key in keys] if isinstance(keys, list) else keys


def check_tenants(tenants: dict[str, TenantConfig], api_keys: list[str]) -> None:
    """ValueError naming the key at fault: a tenant's name, a key given to two tenants, or
    `serve.api_keys` beside `tenants:`."""
    if tenants and api_keys:
        raise ValueError("serve.api_keys: with a tenants section, give each key to its tenant (tenants.NAME.keys)")
    owner: dict[str, str] = {}
    for name, tenant in tenants.items():
        if (error := tenant_name_error(name)) is not None:
            raise ValueError(f"tenants: {error}")
        for key in tenant.keys:
            if key.value is None:
                continue
            if key.value in owner:
                raise ValueError(f"tenants.{name}.keys: a key of tenant {owner[key.value]} too (a key belongs to one tenant)")
            owner[key.value] = name


def retention_s(tenants: dict[str, TenantConfig]) -> dict[str, float]:
    """Tenant -> seconds its records are kept, for the tenants that set `retention_days`."""
    return {name: tenant.retention_days * 86_400 for name, tenant in tenants.items() if tenant.retention_days is not None}
