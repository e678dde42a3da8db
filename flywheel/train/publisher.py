"""Publishing the trainer's weights: the versioned store, the announcement on the bus, and
versions that only ever grow.

A version labels one set of weights that may have sampled tokens. Versions are never reused:
a trainer that restarts from a checkpoint older than what was already published (it died after
publishing) gives the checkpoint's weights a new version above every version published or
announced so far. Serving follows only newer versions, so it then swaps to them, and staleness
(the trainer's version minus a token's) stays an upper bound of how many updates separate them.

Each announcement says where the version comes from (`Lineage`): its parent (the version the
training continued from), the steps and samples since, the steps' metrics averaged, and the
training settings; the promotion loop keeps them in the version registry.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import torch

from flywheel.bus import WEIGHTS_SUBJECT, Bus, WeightUpdate
from flywheel.models import WeightStore

LINEAGE_METRICS = ("reward_mean", "kl", "entropy", "reply_tokens", "loss", "grad_norm", "clip_fraction", "behav_logprob_gap")
"""The step metrics a version's announcement carries (averaged over the steps since its parent)."""
RECENT_IDS = 256


class Lineage:
    """What the trainer did since it last announced a version."""

    def __init__(self, parent: int | None, config: dict[str, Any]):
        self.parent = parent
        self.config = config
        self._reset()

    def _reset(self) -> None:
        self.steps: list[int] = []
        self.samples = 0
        self.sample_ids: deque[str] = deque(maxlen=RECENT_IDS)
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def trained(self, step: int, sample_ids: list[str], metrics: dict[str, Any]) -> None:
        self.steps.append(step)
        self.samples += len(sample_ids)
        self.sample_ids.extend(sample_ids)
        values = {**metrics, "reply_tokens": metrics["tokens"] / len(sample_ids) if sample_ids and metrics.get("tokens") else None}
        for key in LINEAGE_METRICS:
            value = values.get(key)
            if isinstance(value, (int, float)):
                self.sums[key] = self.sums.get(key, 0.0) + float(value)
                self.counts[key] = self.counts.get(key, 0) + 1

    def announced(self, version: int) -> dict[str, Any]:
        """The announcement's lineage fields for `version`; what follows descends from it."""
        fields = {
            "parent": self.parent,
            "trained_on": {"samples": self.samples, "steps": [self.steps[0], self.steps[-1]] if self.steps else [],
                           "sample_digests": list(self.sample_ids)},
            "metrics": {key: self.sums[key] / self.counts[key] for key in self.sums},
            "config": self.config,
        }
        self.parent = version
        self._reset()
        return fields


class WeightPublisher:
    def __init__(self, store: WeightStore, bus: Bus):
        self.store = store
        self.bus = bus

    async def newest(self) -> int | None:
        """The newest version in the store or announced on the bus (None: nothing yet)."""
        announced = await self.bus.last(WEIGHTS_SUBJECT)
        found = [v for v in (self.store.latest(), announced.version if announced else None) if v is not None]
        return max(found, default=None)

    async def publish(self, model: torch.nn.Module, version: int, step: int, lineage: dict[str, Any] | None = None) -> None:
        """Write `version` to the store (unless it is there) and announce it, with its lineage
        (`Lineage.announced`)."""
        if version not in self.store.versions():
            await asyncio.to_thread(self.store.publish, model, version)
        update = WeightUpdate(id=f"weights-v{version}", version=version, path=str(self.store.path(version)), step=step,
                              **(lineage or {}))
        await self.bus.publish(WEIGHTS_SUBJECT, update)
