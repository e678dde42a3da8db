"""Where episodes run: in the rollout driver's process, or on a pool of Ray workers.

Both runners hand out parallel *slots* (an episode holds one from open to close; a sandbox's
uid derives from it, so two episodes never share one) and run `flywheel.rollout.episodes.run_episode`.

- `LocalRunner` (`rollout.n_parallel_envs: 0`): episodes run on the driver's event loop, their
  environment calls in threads; as many slots as `rollout.max_concurrent_rollouts`. For light
  environments (puzzles, HumanEval).
- `RayEnvPool` (`n_parallel_envs: N`): N Ray actors, one slot each, placed by
  `rollout.env_worker_resources`; on a Ray cluster they spread over the nodes that advertise
  those resources. A worker that dies or hangs fails only its own episode: the driver reports
  that episode unscored with the reason, the worker is restarted (killed first if it hung), and
  the slot goes back to the pool once the new worker answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from flywheel.config import FlywheelConfig
from flywheel.config.placement import ray_options
from flywheel.envs import Env, Task, make_env
from flywheel.envs.slots import SlotPool
from flywheel.rollout.episodes import (
    Endpoint,
    EpisodeResult,
    report_failure,
    run_episode,
)

log = logging.getLogger(__name__)


class LocalRunner:
    def __init__(self, config: FlywheelConfig, env: Env, endpoint_url: str, model: str):
        self.config = config
        self.env = env
        self.endpoint = Endpoint(endpoint_url, model)
        self._slots = SlotPool(range(config.rollout.max_concurrent_rollouts))

    async def run(self, task: Task, session_id: str, **turn: Any) -> EpisodeResult:
        async with self._slots.held_async() as slot:
            return await run_episode(self.endpoint, self.env, task, session_id, self.config, slot, **turn)

    async def close(self) -> None:
        await self.endpoint.close()


@ray.remote(max_restarts=-1, max_task_retries=0)
class EnvWorker:
    """One slot of the pool: runs episodes one at a time, in its own process."""

    def __init__(self, config: dict[str, Any], endpoint_url: str, model: str, slot: int):
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s env-{slot} %(name)s %(levelname)s %(message)s")
        self.config = FlywheelConfig.model_validate(config)
        self.env = make_env(self.config.rollout.env, self.config.rollout.env_args)
        self.endpoint = Endpoint(endpoint_url, model)
        self.slot = slot

    async def run(self, task: Task, session_id: str, turn: dict[str, Any]) -> EpisodeResult:
        return await run_episode(self.endpoint, self.env, task, session_id, self.config, self.slot, **turn)

    def pid(self) -> int:
        return os.getpid()


class RayEnvPool:
    def __init__(self, config: FlywheelConfig, endpoint_url: str, model: str):
        self.config = config
        self.endpoint = Endpoint(endpoint_url, model)  # for reporting episodes whose worker failed
        options = ray_options(config.rollout.env_worker_resources)
        self.workers = [
            EnvWorker.options(**options).remote(config.model_dump(mode="json"), endpoint_url, model, slot)
            for slot in range(config.rollout.n_parallel_envs)
        ]
        self._slots = SlotPool(range(len(self.workers)))
        self.worker_failures = 0
        self._reviving: set[asyncio.Task] = set()

    async def run(self, task: Task, session_id: str, **turn: Any) -> EpisodeResult:
        slot = await self._slots.take_async()
        worker = self.workers[slot]
        # Past twice the episode's own limit the worker is hung, not slow.
        deadline = 2 * self.config.rollout.episode.timeout_s
        try:
            result = await asyncio.wait_for(worker.run.remote(task, session_id, turn), deadline)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self.worker_failures += 1
            if isinstance(exc, TimeoutError):
                ray.kill(worker, no_restart=False)  # a hung worker is replaced like a crashed one
            reason = "environment worker hung" if isinstance(exc, TimeoutError) else f"environment worker died: {exc}"
            # The slot goes back once its restarted worker answers, so no episode lands on a restarting one.
            self._reviving.add(asyncio.create_task(self._revive(slot)))
            return await report_failure(self.endpoint, EpisodeResult(session_id, None), reason)
        self._slots.give(slot)
        return result

    async def _revive(self, slot: int) -> None:
        while True:
            try:
                await self.workers[slot].pid.remote()
                break
            except ray.exceptions.RayError:  # still restarting
                await asyncio.sleep(0.2)
        self._slots.give(slot)
        self._reviving.discard(asyncio.current_task())

    async def close(self) -> None:
        for revival in self._reviving:
            revival.cancel()
        for worker in self.workers:
            ray.kill(worker)
        await self.endpoint.close()


def make_runner(config: FlywheelConfig, env: Env, endpoint_url: str, model: str) -> LocalRunner | RayEnvPool:
    """The pool of `rollout.n_parallel_envs` Ray workers, or (0) a runner in this process using `env`."""
    if config.rollout.n_parallel_envs:
        return RayEnvPool(config, endpoint_url, model)
    return LocalRunner(config, env, endpoint_url, model)
