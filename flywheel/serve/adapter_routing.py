"""Which LoRA adapter answers a request (`adapters.kind: lora`), and whether it has a version to
serve yet.

**Routing.** A request's adapter is its tenant's and end user's,
`adapter_for(scope_of(config, tenant), tenant, user)` (flywheel/models/adapter_names.py), when its
`model` is the served model's name. A request may instead name an adapter in `model`:
`<served model>:<adapter>` (e.g. `tiny:acme.u-1f2e...`), or the adapter's name alone (vLLM's way,
e.g. `acme`). A caller may name only its own tenant's adapters, `<tenant>` and `<tenant>.<...>`
(its users', `<tenant>.u-<digest>`), and `shared`; and of those only one that exists here: one
with a published version, or the one its request would be routed to anyway. Any other name (an
adapter of another tenant, published or not, one that was never published, any model this server
does not serve) is the same 404 `model_not_found` with the same message: a tenant learns nothing
of other tenants' adapters. With `adapters.kind: none`, `model` must be the served model's name,
as before.

**Serving.** An adapter with a published version (a `WeightUpdate` with `adapter`, loaded into
every engine: `EnginePool.adapter_versions`) is sent to the engine as `lora_path`. One without a
version yet is served by what the trainer will start it from: a user's adapter by its tenant's
when that one is published (`adapter_names.origin`), else the bare base (no `lora_path`); its
turn is still recorded as its own (`Turn.adapter`) with version 0 for every token, the version
the trainer starts it at.

**Canary.** Under `promotion.mode: canary` a shared or tenant adapter's version on canary
(`Routing.adapter_canaries`, loaded as `canary_name(adapter)`) answers `canary_share` of its
adapter's new sessions, drawn as the shared weights' canary draws (`SessionArms`, one per
gateway for every line). A session stays on the version it started with: one that began before
the canary, or was not drawn, stays with the serving version; one drawn stays on the canary until
it ends. Its turns are the adapter's, with the canary's version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flywheel.models.adapter_names import (
    SHARED,
    adapter_for,
    canary_name,
    origin,
    scope_of,
)
from flywheel.serve.api.errors import APIError
from flywheel.serve.backends.pool import EnginePool
from flywheel.serve.routing import RoutedPool

if TYPE_CHECKING:
    from flywheel.config import FlywheelConfig


@dataclass(frozen=True)
class AdapterChoice:
    """The adapter a request belongs to, `name` (None: the shared weights, `adapters.kind: none`),
    and the one that serves it, `lora_path` (what the engine request names, SGLang's field): `name`
    once it is published, else its origin if that is, else None (the bare base)."""

    name: str | None = None
    lora_path: str | None = None

    def recorded_versions(self, versions: list[int]) -> list[int]:
        """The versions a reply's tokens are recorded with: the engine's when the adapter (or its
        canary) served it; 0 for each token while it has no version of its own (its origin or the
        bare base served it, and the trainer starts it at version 0)."""
        if self.name is not None and self.lora_path not in (self.name, canary_name(self.name)):
            return [0] * len(versions)
        return versions


BASE = AdapterChoice()


class AdapterRouting:
    """The adapter of each request (see the module docstring)."""

    def __init__(self, model_name: str, pool: EnginePool, config: FlywheelConfig | None = None):
        self.model_name = model_name
        self.pool = pool
        self.config = config
        self.enabled = config is not None and config.adapters.kind == "lora"

    def choose(self, model: str, tenant: str, user: str | None, session_id: str) -> AdapterChoice:
        """The adapter of a request for `model` from `tenant`'s end user `user` in session
        `session_id`; a model (or adapter) the caller may not use is a 404."""
        if model == self.model_name:
            if not self.enabled:
                return BASE
            assert self.config is not None
            return self._choice(adapter_for(scope_of(self.config, tenant), tenant, user), session_id)
        named = model[len(self.model_name) + 1:] if model.startswith(f"{self.model_name}:") else model
        if self.enabled and owned(named, tenant):
            assert self.config is not None
            routed = adapter_for(scope_of(self.config, tenant), tenant, user)
            if named == routed or named in self.pool.adapter_versions:
                return self._choice(named, session_id)
        raise self.not_found(model)

    def _choice(self, name: str, session_id: str) -> AdapterChoice:
        if (canary := self._canary(name, session_id)) is not None:
            return AdapterChoice(name, canary)
        return self.serving(name)

    def serving(self, name: str) -> AdapterChoice:
        """What serves adapter `name` outside a canary: its published version, else its origin's, else the bare base."""
        assert self.config is not None
        published = self.pool.adapter_versions
        start = origin(name, self.config)
        return AdapterChoice(name, name if name in published else start if start in published else None)

    def _canary(self, name: str, session_id: str) -> str | None:
        """The engine name of `name`'s canary when it is loaded and this session started on it."""
        if not isinstance(self.pool, RoutedPool) or (routing := self.pool.routing) is None:
            return None
        arm = routing.adapter_canaries.get(name)
        live = arm is not None and self.pool.adapter_versions.get(canary_name(name)) == arm.version
        canary = arm.version if live and arm is not None else None
        return canary_name(name) if self.pool.arms.on_canary(name, session_id, canary, routing.canary_share) else None

    def not_found(self, model: str) -> APIError:
        """The one answer to a model or adapter that is not there for this caller."""
        return APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                        "model_not_found")


def owned(name: str, tenant: str) -> bool:
    """Whether adapter `name` is `tenant`'s own (or the deployment's shared one)."""
    return name == SHARED or name == tenant or name.startswith(f"{tenant}.")
