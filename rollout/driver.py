"""The rollout driver: turns an environment into traffic through the serve endpoint.

For each task it runs `gconfig.n_samples` episodes (attempts), each its own session
(`X-Session-Id`) sharing the task's id (`X-Task-Id`) and saying how many there are
(`X-Group-Size`, so the trainer takes the group whole). An episode is one or more chat turns with
the official `openai` client, acting in the environment between turns, graded at its end; the
grade goes back as session feedback (`POST /v1/sessions/{id}/feedback`, source `env`), which
closes the session (rollout/episodes.py). Episodes run in the driver's process or on a pool of Ray
workers (`rollout.n_parallel_envs`, rollout/env_pool.py). The driver is one more client of the
endpoint: the collector, judge and trainer treat its traffic like anyone's.

Staleness control (AReaL's admission rule): with η = `rollout.max_head_offpolicyness`, B =
`train.batch_size` and v the newest weight version announced on the bus, a group of n samples
may start only while accepted + running + n <= (η + v + 1)·B and running + n <= the concurrency
cap (`rollout.max_concurrent_rollouts`). `accepted` counts samples whose verdict was reported.

Data position: after each task drawn, the driver writes how many tasks it has drawn and its RNG
state to `run_dir/rollout_state.json` (atomically); with `train.resume` it continues from there,
so a resumed run draws the tasks the stopped one would have drawn next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from bus import WEIGHTS_SUBJECT, Bus
from bus.process import repeat
from config import ConfigError, FlywheelConfig
from envs import ENVS, Env, Task, make_env
from rollout.env_pool import make_runner

log = logging.getLogger(__name__)


class RolloutDriver:
    def __init__(self, config: FlywheelConfig, bus_url: str, endpoint: str | None = None):
        self.config = config
        self.bus_url = bus_url
        self.endpoint = (endpoint or config.rollout.endpoint or "").rstrip("/")
        if not self.endpoint:
            raise ConfigError("rollout.endpoint: no endpoint to send rollouts to")
        try:
            self.env: Env = make_env(config.rollout.env, config.rollout.env_args)
        except (TypeError, ValueError) as exc:
            key = "rollout.env" if config.rollout.env not in ENVS else "rollout.env_args"
            raise ConfigError(f"{key}: {exc}") from None
        self.rng = random.Random(config.seed)
        self.tasks_drawn = 0
        self.length_rng = random.Random(config.seed + 1)
        self.state_path = Path(config.run_dir) / "rollout_state.json"
        if config.train.resume and self.state_path.exists():
            state = json.loads(self.state_path.read_text())
            version, internal, gauss = state["rng"]
            self.rng.setstate((version, tuple(internal), gauss))
            self.tasks_drawn = state["tasks_drawn"]
        self.version = 0
        self.running = 0
        self.accepted = 0
        self.failed = 0
        self.recent_rewards: deque[float] = deque(maxlen=256)
        self.recent_turns: deque[int] = deque(maxlen=256)
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._groups: set[asyncio.Task] = set()

    def capacity(self, group: int) -> bool:
        """Whether a group of `group` samples may start now (the staleness bound)."""
        bound = (self.config.rollout.max_head_offpolicyness + self.version + 1) * self.config.train.batch_size
        return (
            self.accepted + self.running + group <= bound
            and self.running + group <= self.config.rollout.max_concurrent_rollouts
        )

    async def start(self) -> None:
        self.bus = await Bus.connect(self.bus_url, name="rollout", replicas=self.config.bus.replicas)
        self.runner = make_runner(self.config, self.env, self.endpoint, self.config.served_model)
        self._tasks = [
            asyncio.create_task(repeat(self._follow_versions, "rollout.versions"), name="versions"),
            asyncio.create_task(self._admit(), name="admit"),
        ]

    async def _follow_versions(self) -> None:
        async for update in self.bus.follow(WEIGHTS_SUBJECT, newest_only=True):
            self.version = max(self.version, update.version)
            self._changed.set()

    async def _admit(self) -> None:
        n = self.config.gconfig.n_samples
        while True:
            while not self.capacity(n):
                self._changed.clear()
                await self._changed.wait()
            task = self.env.reset(self.rng)
            self.tasks_drawn += 1
            self._save_position()
            self.running += n
            group = asyncio.create_task(self._run_group(task, n))
            self._groups.add(group)
            group.add_done_callback(self._groups.discard)

    def draw_length(self) -> int:
        """A heavy-tailed generation length (`gconfig.length_tail`): inverse-CDF sampling of a
        Pareto tail truncated to [min_new_tokens, max_new_tokens]."""
        g = self.config.gconfig
        lo, hi, alpha = g.min_new_tokens, max(g.min_new_tokens, g.max_new_tokens), g.length_tail
        u = self.length_rng.random()
        tail = 1.0 - u * (1.0 - (lo / hi) ** alpha)
        return min(hi, int(lo / tail ** (1.0 / alpha)))

    def _save_position(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tasks_drawn": self.tasks_drawn, "rng": self.rng.getstate()}))
        os.replace(tmp, self.state_path)

    async def _run_group(self, task: Task, n: int) -> None:
        await asyncio.gather(*(self._run_one(task, k) for k in range(n)))

    async def _run_one(self, task: Task, k: int) -> None:
        session_id = f"{task.id}-{k}-{uuid.uuid4().hex[:8]}"
        turn: dict = {}
        if self.config.gconfig.length_tail is not None:
            turn = {"turn_length": self.draw_length(), "extra_body": {"ignore_eos": True}}
        try:
            result = await self.runner.run(task, session_id, **turn)
            if result.reward is None:
                self.failed += 1
            else:
                self.accepted += 1
                self.recent_rewards.append(result.reward)
                self.recent_turns.append(result.turns)
        except Exception as exc:
            self.failed += 1
            log.warning("rollout %s failed: %s", session_id, exc)
        finally:
            self.running -= 1
            self._changed.set()

    async def stop(self) -> None:
        for task in [*self._tasks, *self._groups]:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, *self._groups, return_exceptions=True)
        await self.runner.close()
        await self.bus.close()

    def stats(self) -> dict[str, Any]:
        rewards = list(self.recent_rewards)
        return {
            "version": self.version,
            "running": self.running,
            "accepted": self.accepted,
            "failed": self.failed,
            "tasks_drawn": self.tasks_drawn,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "turns_mean": sum(self.recent_turns) / len(self.recent_turns) if self.recent_turns else None,
        }
