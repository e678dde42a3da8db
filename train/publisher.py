"""Publishing the trainer's weights: the versioned store, the announcement on the bus, and
versions that only ever grow.

A version labels one set of weights that may have sampled tokens. Versions are never reused:
a trainer that restarts from a checkpoint older than what was already published (it died after
publishing) gives the checkpoint's weights a new version above every version published or
announced so far. Serving follows only newer versions, so it then swaps to them, and staleness
(the trainer's version minus a token's) stays an upper bound of how many updates separate them.
"""

from __future__ import annotations

import asyncio

import torch

from bus import WEIGHTS_SUBJECT, Bus, WeightUpdate
from models import WeightStore


class WeightPublisher:
    def __init__(self, store: WeightStore, bus: Bus):
        self.store = store
        self.bus = bus

    async def newest(self) -> int | None:
        """The newest version in the store or announced on the bus (None: nothing yet)."""
        announced = await self.bus.last(WEIGHTS_SUBJECT)
        found = [v for v in (self.store.latest(), announced.version if announced else None) if v is not None]
        return max(found, default=None)

    async def publish(self, model: torch.nn.Module, version: int, step: int) -> None:
        """Write `version` to the store (unless it is there) and announce it."""
        if version not in self.store.versions():
            await asyncio.to_thread(self.store.publish, model, version)
        await self.announce(version, step)

    async def announce(self, version: int, step: int) -> None:
        update = WeightUpdate(id=f"weights-v{version}", version=version, path=str(self.store.path(version)), step=step)
        await self.bus.publish(WEIGHTS_SUBJECT, update)
