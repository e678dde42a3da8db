"""Each loop as a Ray actor: one generic async actor that builds, starts, reports and stops a loop.

The loop starts in the actor's constructor, so when Ray restarts an actor whose process or node
died (`max_restarts=-1`) the loop comes back on its own: it resumes from the bus (its durable
consumer gets back what its predecessor held) and, for train, from its last checkpoint. Where an
actor runs is set by `deploy.resources` (`Deployment` passes the options); by default it holds
no reservation (`num_cpus=0`): the loops are long-lived services, and fractional reservations on
a small machine can starve Ray's own tasks. Loop classes are imported inside
the actor, so a process only loads what its loop needs (collect and judge never import torch).
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from flywheel.config.imports import import_object
from flywheel.deploy.loop_classes import LOOPS
from flywheel.runtime import tune_gc


@ray.remote(num_cpus=0, max_concurrency=16, max_restarts=-1)
class LoopActor:
    """Hosts one loop (`kind` in LOOPS) on the actor's event loop, started when the actor is."""

    async def __init__(self, kind: str, config: dict[str, Any], bus_url: str):
        from flywheel.config import FlywheelConfig

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {kind} %(name)s %(levelname)s %(message)s")
        self.kind = kind
        tune_gc()
        self.loop = import_object(LOOPS[kind])(FlywheelConfig.model_validate(config), bus_url)
        self.started = await self.loop.start()

    async def address(self) -> Any:
        """What the loop's `start` returned (serve: its URL)."""
        return self.started

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def stats(self) -> dict[str, Any]:
        return self.loop.stats()

    async def stop(self) -> None:
        await self.loop.stop()
