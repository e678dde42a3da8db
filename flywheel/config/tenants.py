"""Tenants: the customers of one deployment, each with its own API keys (`tenants.NAME.*`).

A tenant owns its keys, its sessions and its records. Without a `tenants:` section each key in
`serve.api_keys` is a tenant of its own (two keys share data only when one tenant holds both),
and with no keys at all there is one open tenant (`open`). Part of
`flywheel.config.schema.FlywheelConfig`; the gateway's `TenantDirectory`
(flywheel/serve/ops/tenants.py) resolves a request's key to its tenant.
"""

from __future__ import annotations

import re

from pydantic import Field

from flywheel.config.section import Section

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
"""Lowercase letters, digits, `_` and `-`, at most 63: safe in a subject on the bus and in a path."""
OPEN_TENANT = "open"
"""The one tenant of a deployment with no keys at all."""


class TenantConfig(Section):
    """A customer: its client keys."""

    keys: list[str] = Field(default_factory=list)
    """Client keys, by value (`Authorization: Bearer <key>` or `x-api-key`)."""
    key_envs: list[str] = Field(default_factory=list)
    """Names of environment variables holding more of its keys, read when a gateway starts (one
    that is not set there is an error naming it): keys out of the configuration file."""


def check_tenants(tenants: dict[str, TenantConfig], api_keys: list[str]) -> None:
    """ValueError naming the key at fault: a tenant's name, a key given to two tenants, or
    `serve.api_keys` beside `tenants:`."""
    if tenants and api_keys:
        raise ValueError("serve.api_keys: with a tenants section, give each key to its tenant (tenants.NAME.keys)")
    owner: dict[str, str] = {}
    for name, tenant in tenants.items():
        if not TENANT_NAME.match(name):
            raise ValueError(f"tenants: {name!r} is not a tenant name (lowercase letters, digits, _ and -; at most 63)")
        for key in tenant.keys:
            if not key:
                raise ValueError(f"tenants.{name}.keys: a key cannot be empty")
            if key in owner:
                raise ValueError(f"tenants.{name}.keys: a key of tenant {owner[key]} too (a key belongs to one tenant)")
            owner[key] = name
