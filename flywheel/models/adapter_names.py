"""Which adapter a request uses and its samples train, and the adapter's name.

With `adapters.kind: lora` every request belongs to one adapter, chosen by its tenant and end
user under the scope (`adapters.scope`, or the tenant's `adapter_scope`):

- `shared`: `shared`, one for the deployment;
- `tenant`: `<tenant>`;
- `user`: `<tenant>.u-<digest of the user id>`, or the tenant's adapter for a request without a
  user. The user id is hashed: a name appears in paths, engine requests and logs, and a user id
  is the caller's own string (any characters, personal perhaps).

Names use only letters, digits, `.`, `_` and `-` (the engines' and the adapter store's rule).
The gateway (routing a request) and the trainer (assigning a sample: `sample_adapter`) both call
`adapter_for`, so a sample always trains the adapter that sampled it. A user's new adapter starts
from its tenant's (`origin`), when the trainer has that one.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flywheel.config import FlywheelConfig

SHARED = "shared"
GATE_SIDES = ("gate.candidate", "gate.serving")
"""The names under which the promotion gate loads the two versions of an adapter it compares, on
the evaluation server (no tenant's or user's adapter is named so: a user's is `<tenant>.u-...`)."""


CANARY = "Canary."


def canary_name(adapter: str) -> str:
    """The engine name under which a shared or tenant adapter's version on canary is loaded, beside
    its serving version (`Canary.<adapter>`: no adapter's name and no tenant's has a capital, so
    no request's `model` names it as one it may use)."""
    return CANARY + adapter


def canary_adapter(name: str) -> str | None:
    """The adapter whose canary engine `name` names (None: no canary's)."""
    return name.removeprefix(CANARY) if name.startswith(CANARY) else None


def user_adapter(tenant: str, user: str) -> str:
    digest = hashlib.blake2b(user.encode(), digest_size=8, person=b"flywheel-user").hexdigest()
    return f"{tenant}.u-{digest}"


def is_personal(name: str) -> bool:
    """Whether `name` is an end user's own adapter (`<tenant>.u-<digest>`; tenant names have no
    `.`), not the deployment's or a tenant's. Under `promotion.mode` only the others go through the
    gate: a user's own adapter is its user's alone, guarded by `adapters.guard_drop`."""
    return "." in name


def adapter_for(scope: str, tenant: str, user: str | None) -> str:
    """The adapter of a request (or sample) of `tenant` and `user` under `scope`."""
    if scope == "shared":
        return SHARED
    if scope == "user" and user:
        return user_adapter(tenant, user)
    return tenant


def scope_of(config: FlywheelConfig, tenant: str) -> str:
    """The scope that holds for `tenant`: its own `adapter_scope`, else `adapters.scope`."""
    own = config.tenants[tenant].adapter_scope if tenant in config.tenants else None
    return own or config.adapters.scope


def sample_adapter(sample: Any, config: FlywheelConfig) -> str:
    """The adapter a sample (with its trajectory) trains: the one that sampled it, else its
    tenant's and user's."""
    trajectory = sample.trajectory
    if trajectory.adapter:
        return trajectory.adapter
    return adapter_for(scope_of(config, trajectory.tenant), trajectory.tenant, trajectory.user_id)


def origin(name: str, config: FlywheelConfig) -> str | None:
    """The adapter that `name`, new, starts from: its tenant's when `name` is a user's adapter
    (`<tenant>.u-<digest>`, under the `user` scope); else none (PEFT's initialisation: the base
    exactly)."""
    tenant, user, _ = name.rpartition(".u-")
    return tenant if user and scope_of(config, tenant) == "user" else None
