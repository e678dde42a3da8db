"""Serving under promotion: which version answers a session (`promotion.mode` gate or canary).

The gateway follows the registry's `Routing` (`flywheel/versions/records.py`) instead of every weight
announcement: the serving engines load the version it says serves (an older one too, after a
rollback), and while a canary runs, a second set of engines loads the canary version. Those are
the external engines in `promotion.canary.engine_urls`, or, with the embedded engine, a second
embedded engine created when the first canary starts (one more copy of the weights in memory).

Sessions are sticky (`SessionArms`, which adapters' canaries use too, per line of versions): a
new session goes to the canary with probability `canary_share` (a hash of its id and the canary
version, so every gateway in front of the same engines decides alike), and stays on the arm it
started on while that canary runs, so its turns continue exactly and are attributed to one
version. A session begun before the canary, or not drawn, stays with the serving version; when
the canary ends (promoted or rolled back) its sessions go on with the serving version. Sessions
without an id are each a session of their own.
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


WEIGHTS = ""
"""The shared weights' line in `SessionArms` (an adapter's line is the adapter's name)."""


class SessionArms:
    """The arm each recent session started on, per line of versions: the canary version it was
    drawn onto, or -1 for the serving one. One LRU of `capacity` (line, session) entries."""

    def __init__(self, capacity: int):
        self._started: LRU[tuple[str, str], int] = LRU(capacity)
        self.counts: dict[tuple[str, str], int] = {}
        """New sessions of each (line, arm) while the line had a canary."""

    def on_canary(self, line: str, session_id: str, canary: int | None, share: float) -> bool:
        """Whether `session_id` goes to `line`'s canary, version `canary` (None: no canary is live).
        A session's first request draws it while a canary is live; later ones keep that draw."""
        key = (line, session_id)
        started = self._started.get(key)
        if started is None:
            drawn = canary is not None and canary_draw(session_id, canary) < share
            self._started[key] = started = canary if drawn else -1
            if canary is not None:
                arm = (line, "canary" if drawn else "serving")
                self.counts[arm] = self.counts.get(arm, 0) + 1
        return canary is not None and started == canary

    def __len__(self) -> int:
        """(line, session) entries kept."""
        return len(self._started)


class RoutedPool(EnginePool):
    """The serving engines, plus the canary's when there is one; `route` picks the session's arm.
    Everything else an `EnginePool` does (swaps, versions, health) is about the serving engines."""

    def __init__(self, serving: list[EngineClient], sessions: int = 100_000, frozen: bool = False):
        super().__init__(serving)
        self.frozen = frozen
        """The shared weights never change (adapters train instead): no canary of theirs runs, so
        `route` keeps no session for their line (`arms` holds the adapters' lines alone)."""
        self.canary: EnginePool | None = None
        self.routing: Routing | None = None
        self.arms = SessionArms(sessions)
        """The arm each recent session started on, for the shared weights and each adapter."""

    @property
    def all_engines(self) -> list[EngineClient]:
        return [*self.engines, *(self.canary.engines if self.canary else [])]

    def _adapter_engines(self) -> list[EngineClient]:
        """Adapters go to the canary's engines too (those there when the adapter is loaded)."""
        return self.all_engines

    def _live_canary(self) -> int | None:
        """The canary's version once its engines have loaded it, else None."""
        canary = self.routing.canary if self.routing is not None else None
        if canary is None or self.canary is None or self.canary.weight_version != canary.version:
            return None
        return canary.version

    def route(self, session_id: str) -> EngineClient:
        if self.frozen:
            return super().route(session_id)
        share = self.routing.canary_share if self.routing is not None else 0.0
        if self.arms.on_canary(WEIGHTS, session_id, self._live_canary(), share):
            assert self.canary is not None
            return self.canary.route(session_id)
        return super().route(session_id)

    async def close(self) -> None:
        await super().close()
        if self.canary is not None:
            await self.canary.close()
