"""The judge loop: trajectories in, scored samples out.

Consumes TRAJECTORIES durably, scores each with the configured judge and publishes a `Sample`
(its id is the trajectory's, so a re-publish after a crash is dropped as a duplicate). A
trajectory the judge cannot score is counted and logged, and acknowledged without a sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from bus import SAMPLE_SUBJECT, TRAJECTORY_SUBJECT, Bus, Sample, Trajectory
from bus.process import repeat
from config import FlywheelConfig
from judge.rule import RuleJudge

log = logging.getLogger(__name__)

JUDGES = {"rule": RuleJudge}


class JudgeLoop:
    def __init__(self, config: FlywheelConfig, bus_url: str, durable: str = "judge"):
        self.config = config
        self.bus_url = bus_url
        self.durable = durable
        self.judge = JUDGES[config.judge.kind]()
        self.counts = {"scored": 0, "unscored": 0}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.bus = await Bus.connect(self.bus_url, name="judge")
        self.consumer = self.bus.consumer(TRAJECTORY_SUBJECT, self.durable)
        self._task = asyncio.create_task(repeat(self._step, "judge"), name="judge")

    async def _step(self) -> None:
        for delivery in await self.consumer.fetch(batch=256, timeout_s=0.5):
            trajectory = delivery.record
            assert isinstance(trajectory, Trajectory)
            scored = self.judge.score(trajectory)
            if scored is None:
                self.counts["unscored"] += 1
                log.warning("trajectory %s has no reward the %s judge can use", trajectory.id, self.judge.name)
            else:
                reward, turn_rewards = scored
                sample = Sample(
                    id=trajectory.id, trajectory=trajectory, reward=reward, turn_rewards=turn_rewards, judge=self.judge.name
                )
                await self.bus.publish(SAMPLE_SUBJECT, sample)
                self.counts["scored"] += 1
            await delivery.ack()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.bus.close()

    def stats(self) -> dict[str, Any]:
        return dict(self.counts, malformed=self.consumer.malformed)
