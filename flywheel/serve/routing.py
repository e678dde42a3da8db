"""Serving under promotion: which version answers a session (`promotion.mode` gate or canary).

The gateway follows the registry's `Routing` (`flywheel/versions/records.py`) instead of every weight
announcement: the serving engines load the version it says serves (an older one too, after a
rollback), and while a canary runs, a second set of engines loads the canary version. Those are
the external engines in `promotion.canary.engine_urls`, or, with the embedded engine, a second
embedded engine created when the first canary starts (one more copy of the weights in memory).

Sessions are sticky: a new session goes to the canary with probability `canary_share` (a hash of
its id and the canary version, so every gateway in front of the same engines decides alike), and
stays on the version it started with while that version is served by either set, so its turns
continue exactly and are attributed to one version. When its version stops being served (the
canary promoted or rolled back) the session goes on with the serving version. Sessions without
an id are each a session of their own.
"""

from __future__ import annotations

import hashlib

from flywheel.lru import LRU
from flywheel.serve.backends.base import EngineClient
from flywheel.serve.backends.pool import EnginePool
from flywheel.versions.records import Routing


def canary_draw(session_id: str, version: int) -> float:
    """A number in [0, 1) fixed by the session and the canary version."""
    digest = hashlib.blake2b(f"{version}\0{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class RoutedPool(EnginePool):
    """The serving engines, plus the canary's when there is one; `route` picks the session's arm.
    Everything else an `EnginePool` does (swaps, versions, health) is about the serving engines."""

    def __init__(self, serving: list[EngineClient], sessions: int = 100_000):
        super().__init__(serving)
        self.canary: EnginePool | None = None
        self.routing: Routing | None = None
        self.sessions: LRU[str, int] = LRU(sessions)
        """The version each recent session started with."""
        self.counts = {"serving": 0, "canary": 0}
        """New sessions sent to each arm."""

    @property
    def all_engines(self) -> list[EngineClient]:
        return [*self.engines, *(self.canary.engines if self.canary else [])]

    def _adapter_engines(self) -> list[EngineClient]:
        """Adapters go to the canary's engines too (those there when the adapter is loaded)."""
        return self.all_engines

    def _canary_live(self) -> bool:
        return (self.routing is not None and self.routing.canary is not None and self.canary is not None
                and self.canary.weight_version == self.routing.canary.version)

    def route(self, session_id: str) -> EngineClient:
        version = self.sessions.get(session_id)
        canary_live = self._canary_live()
        if version is not None:
            if canary_live and version == self.canary.weight_version:
                return self.canary.route(session_id)
            self.sessions[session_id] = self.weight_version  # its version is served no more (or by these engines)
            return super().route(session_id)
        if canary_live and canary_draw(session_id, self.routing.canary.version) < self.routing.canary_share:
            self.sessions[session_id] = self.canary.weight_version
            self.counts["canary"] += 1
            return self.canary.route(session_id)
        self.sessions[session_id] = self.weight_version
        self.counts["serving"] += 1
        return super().route(session_id)

    async def close(self) -> None:
        await super().close()
        if self.canary is not None:
            await self.canary.close()
