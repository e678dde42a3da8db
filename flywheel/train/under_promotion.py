"""The trainer when versions must earn their traffic (`promotion.mode` not off): what it reads
from the version registry (`flywheel/versions/registry.py`) before each step.

- **Directives.** After a version is rejected or rolled back, the promotion loop tells the trainer
  what to continue from (`TrainerDirective`, `promotion.continue_from`): the weights of that
  version, with a fresh optimizer state (its moments were built along the abandoned path). The
  versions it published after that one are abandoned: samples with tokens from them are not
  trained (`abandoned_dropped`), and they do not count as updates between two versions. A
  directive about a version the trainer's weights do not descend from (they were sent back
  before it was rejected) is passed over: it would abandon the line the trainer went on with.
- **Distance.** Staleness is counted in updates a sample's weights are behind the trainer's:
  the versions between them, less the abandoned ones (a version trained from v3 after v4 and v5
  were abandoned is one update from v3, not three).
- **Pace.** The trainer takes a step only if the version it makes is at most max(η, 1) updates
  ahead of the version serving everyone (η: `rollout.max_head_offpolicyness`): traffic comes
  from that version, so what it trains on stays within η, and a trainer further ahead would find
  every sample stale (under a slow gate it would publish candidates nobody serves). At η = 0 it
  makes one candidate and waits for it to be decided. Samples keep arriving meanwhile and wait.
- **Protection.** The weight store never prunes the versions that serve (serving, canary) or the
  last good one (what a rollback returns to).

A shared or tenant LoRA adapter (`adapters.kind: lora`) is a line of its own, with one
`UnderPromotion` each (`adapter`; flywheel/train/adapter_versions.py holds them): its serving
version is the routing's (`Routing.adapters`; 0, its start, until one passed the gate), its
directives its own, and its pace counted in its own versions.
"""

from __future__ import annotations

import logging
from bisect import bisect_right, insort
from typing import Any

from flywheel.versions.records import Routing, TrainerDirective, last_good
from flywheel.versions.registry import Registry

log = logging.getLogger(__name__)


class UnderPromotion:
    def __init__(self, registry: Registry, max_ahead: int, adapter: str | None = None):
        self.registry = registry
        self.max_ahead = max_ahead
        self.adapter = adapter
        self.abandoned: list[int] = []
        """Versions abandoned by directives, sorted."""
        self.applied: set[str] = set()
        """Directive ids already carried out or passed over (checkpointed with the trainer)."""
        self.parents: dict[int, int] = {}
        """The parent of each version this trainer announced (checkpointed with the trainer)."""
        self.serving: int | None = None
        self.protected: set[int] = set()

    def distance(self, newer: int, older: int) -> int:
        """Updates between two versions: the versions in (older, newer] that were not abandoned."""
        skipped = bisect_right(self.abandoned, newer) - bisect_right(self.abandoned, older)
        return newer - older - skipped

    def is_abandoned(self, version: int) -> bool:
        i = bisect_right(self.abandoned, version)
        return i > 0 and self.abandoned[i - 1] == version

    async def refresh(self, routing: Routing | None) -> TrainerDirective | None:
        """Take the serving version from `routing` (read once a step for every line) and read
        this line's directive; the directive if it is new (not yet applied)."""
        if routing is not None and self.adapter is not None:
            canary = routing.adapter_canaries.get(self.adapter)
            self.serving = routing.serving_version(self.adapter)
            self.protected = {self.serving, *([canary.version] if canary else [])}
        elif routing is not None:
            self.serving = routing.serving.version
            good = last_good(await self.registry.versions())
            self.protected = {routing.serving.version, *([good.version] if good else []),
                              *([routing.canary.version] if routing.canary else [])}
        directive = await self.registry.directive(self.adapter)
        if directive is None or directive.id in self.applied:
            return None
        return directive

    def announced(self, version: int, parent: int) -> None:
        self.parents[version] = parent

    def concerns(self, directive: TrainerDirective, weights: int) -> bool:
        """Whether the directive's rejected version is `weights` (the version the trainer's weights
        continue from) or may be one of its ancestors: yes when met on the way back through the
        parents this trainer announced, and when older than the first version whose parent it
        does not know (a version it did not announce, as after a resume from an older checkpoint)."""
        rejected, version = directive.rejected, weights
        if rejected is None:
            return True
        while version != rejected and version in self.parents:
            version = self.parents[version]
        return rejected <= version

    def pass_over(self, directive: TrainerDirective) -> None:
        self.applied.add(directive.id)
        log.info("directive about v%s passed over: these weights do not descend from it (%s)", directive.rejected, directive.reason)

    def abandon(self, directive: TrainerDirective, current: int) -> None:
        """Mark the versions the directive abandons: (abandon_after, current]."""
        for version in range(directive.abandon_after + 1, current + 1):
            self.skip(version)
        self.applied.add(directive.id)
        log.info("continuing from v%d (%s); versions %d..%d abandoned", directive.version, directive.reason,
                 directive.abandon_after + 1, current)

    def skip(self, version: int) -> None:
        """`version` is not on the line (abandoned, or never published: an adapter's held back)."""
        if not self.is_abandoned(version):
            insort(self.abandoned, version)

    def may_step(self, version: int) -> bool:
        """Whether the trainer at `version` may take a step (it is not too far ahead of serving)."""
        return self.serving is None or self.distance(version, self.serving) + 1 <= max(self.max_ahead, 1)

    def state(self) -> dict[str, Any]:
        return {"abandoned": list(self.abandoned), "applied": sorted(self.applied),
                "parents": [[version, parent] for version, parent in sorted(self.parents.items())]}

    def restore(self, state: dict[str, Any]) -> None:
        self.abandoned = sorted(state.get("abandoned", []))
        self.applied = set(state.get("applied", []))
        self.parents = {version: parent for version, parent in state.get("parents", [])}
