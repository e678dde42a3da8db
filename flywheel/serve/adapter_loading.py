"""Which versions of the LoRA adapters a gateway loads into its engines, and from where
(`adapters.kind: lora`).

- **Announced** (`take`): a `WeightUpdate` with `adapter` is loaded into every engine when it is
  newer than the version served. Every gateway loads it (also with `serve.swap_weights: false`):
  loading a version an engine has already is harmless, and a gateway must not send a request for
  an adapter version its engines may not have yet.
- **Stored** (`load_stored`): before the first request, the newest version of every adapter in
  the trainer's store (`run_dir/adapters`, flywheel/models/adapter_store.py): the WEIGHTS stream
  keeps only the newest announcements, so a gateway that starts after many adapters were
  published finds the others there. (An engine reads an adapter's weights on its first request.)
- **Routed** (`take_routed`): under promotion the shared and tenant adapters serve once they
  passed the gate, the version the registry's routing names (`Routing.adapters`), and only end
  users' own adapters as announced or stored (`announced`). A routed version is loaded when the
  routing changes it (only then: a forgotten tenant's adapter, unloaded, is not loaded again
  from a routing that still names it). An adapter's version on canary (`Routing.adapter_canaries`)
  is loaded beside the serving one under its own engine name (`canary_name`), and unloaded when
  its canary ends.
- **Forgotten** (`forget`): a forgotten tenant's or user's adapters leave every engine, their
  canaries too. A routed adapter the routing names no more (a line rolled back to its start,
  whose bare base then serves; an ended canary) leaves them as well.
"""

from __future__ import annotations

import logging
from pathlib import Path

from flywheel.bus import WeightUpdate
from flywheel.models.adapter_names import canary_adapter, canary_name, is_personal
from flywheel.models.adapter_store import AdapterStore, owned_by
from flywheel.serve.backends.pool import EnginePool
from flywheel.versions.records import Routing

log = logging.getLogger(__name__)


class AdapterLoading:
    def __init__(self, pool: EnginePool, run_dir: str | Path, routed: bool):
        self.pool = pool
        self.store = AdapterStore(Path(run_dir) / "adapters")
        self.routed = routed
        """Whether versions must earn their traffic (`promotion.mode` on, a policy gateway)."""
        self.routed_versions: dict[str, int] = {}
        """The version of each shared or tenant adapter the routing last had this gateway load, and
        of each canary (by its engine name)."""

    def announced(self, adapter: str) -> bool:
        """Whether `adapter`'s versions serve as they are announced: all do, but a shared or tenant
        adapter's under promotion."""
        return not self.routed or is_personal(adapter)

    async def load_stored(self) -> None:
        for name in filter(self.announced, self.store.names()):
            version = self.store.latest(name)
            if version is not None:
                await self.take(WeightUpdate(id=f"{name}-v{version}", version=version,
                                             path=str(self.store.path(name, version)), step=0, adapter=name))

    async def take(self, update: WeightUpdate) -> None:
        assert update.adapter is not None
        if not self.announced(update.adapter) or update.version <= self.pool.adapter_versions.get(update.adapter, 0):
            return
        try:
            await self.pool.load_adapter(update.adapter, update.path, update.version)
        except Exception:
            log.exception("could not load adapter %s v%d from %s", update.adapter, update.version, update.path)

    async def take_routed(self, routing: Routing) -> None:
        routed = {**routing.adapters, **{canary_name(name): arm for name, arm in routing.adapter_canaries.items()}}
        for name, arm in routed.items():
            if arm.path is not None and self.routed_versions.get(name) != arm.version:
                try:
                    await self.pool.load_adapter(name, arm.path, arm.version)
                    self.routed_versions[name] = arm.version
                except Exception:
                    log.exception("could not load adapter %s v%d from %s", name, arm.version, arm.path)
        await self._unload([name for name in self.routed_versions if name not in routed])  # an ended canary; a line back
        # at its start (rolled back to it, or forgotten), which the bare base serves

    async def forget(self, tenant: str, user: str | None) -> None:
        """A forgotten tenant's or end user's adapters, and their canaries, served no more by any engine."""
        owned = set(owned_by([canary_adapter(n) or n for n in self.pool.adapter_versions], tenant, user))
        await self._unload([name for name in self.pool.adapter_versions if (canary_adapter(name) or name) in owned])

    async def _unload(self, names: list[str]) -> None:
        for name in names:
            self.routed_versions.pop(name, None)  # loaded afresh should a routing name it again
            try:
                await self.pool.unload_adapter(name)
            except Exception:  # no request is sent to it any more; only the engine's memory still holds it
                log.exception("could not unload adapter %s from every engine", name)
