"""The rollout driver: turns an environment into traffic through the serve endpoint.

For each task it runs `rollout.sampling.n_samples` episodes (attempts), each its own session
(`X-Session-Id`) sharing the task's id (`X-Task-Id`) and saying how many there are
(`X-Group-Size`, so the trainer takes the group whole). An episode is one or more chat turns with
the official `openai` client, acting in the environment between turns, graded at its end; the
grade goes back as session feedback (`POST /v1/sessions/{id}/feedback`, source `env`), which
closes the session (flywheel/rollout/episodes.py). Episodes run in the driver's process or on a pool of Ray
workers (`rollout.n_parallel_envs`, flywheel/rollout/env_pool.py). The driver is one more client of the
endpoint: the collector, judge and trainer treat its traffic like anyone's.

Staleness control (AReaL's admission rule): with η = `rollout.max_head_offpolicyness`, B =
`train.batch_size` and v the newest weight version announced on the bus and served by the
endpoint (its `/health` says so: until then episodes would run on the version before; under
promotion, the version serving everyone plus the versions above it the trainer abandoned,
`_follow_registry`), a group of n samples
may start only while accepted + running + n <= (η + v + 1)·B and running + n <= the concurrency
cap (`rollout.max_concurrent_rollouts`). `accepted` counts samples whose verdict was reported,
added when their group ends (all its episodes): a group holds its n slots in `running` until then.

Restarts: after each task drawn and each episode ended, the driver writes its state to
`run_dir/rollout_state.json` (atomically): the tasks drawn, the task RNG, the generation-length
RNG (a task's lengths are drawn with it), `accepted` and `failed`. A driver started on a run_dir
that holds this file continues from it, whether the run was resumed (`train.resume`) or Ray
restarted the driver's actor within a run (as the trainer always continues from its newest
checkpoint): it draws the tasks and lengths the previous driver would have drawn next, and its
admission bound counts the samples accepted before (v comes back from the bus). `running`
starts at 0: the groups a dead driver was running die with it and are counted nowhere. Their
episodes that had not ended close without the environment's verdict (the rule judge publishes
them unscored); the verdicts of those that had reach the trainer as a group that times out
incomplete. So the trainer gets a few samples more than the driver counted, never fewer: counted
per episode, a half-finished group's verdicts would use admission slots without ever filling a
batch, and at η = 0 a resumed run waited forever for samples nothing would send.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from flywheel.bus import WEIGHTS_SUBJECT, Bus
from flywheel.bus.streams import DIRECTIVE_SUBJECT, ROUTING_SUBJECT
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.config.tenants import retention_s
from flywheel.envs import ENVS, Env, Task, make_env
from flywheel.rollout.env_pool import make_runner
from flywheel.runtime import cancel_and_wait, repeat, together
from flywheel.versions.records import abandoned_above
from flywheel.versions.registry import Registry

log = logging.getLogger(__name__)

SERVED_WAIT_S = 120.0
"""The longest the admission bound waits for the endpoint to serve a newly announced version."""


def _rng_state(saved: list) -> tuple:
    """`random.Random.getstate()` back from JSON, which made its tuples lists."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss


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
        self.length_rng = random.Random(config.seed + 1)
        self.tasks_drawn = 0
        self.accepted = 0
        self.failed = 0
        self.state_path = Path(config.run_dir) / "rollout_state.json"
        if self.state_path.exists():
            self._restore(json.loads(self.state_path.read_text()))
        self.version = 0
        self.running = 0
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
        self.bus = await Bus.connect(self.bus_url, name="rollout", replicas=self.config.bus.replicas,
                                  retention=retention_s(self.config.tenants))
        self.runner = make_runner(self.config, self.env, self.endpoint, self.config.served_model)
        self._tasks = [
            asyncio.create_task(repeat(self._follow_versions, "rollout.versions"), name="versions"),
            asyncio.create_task(self._admit(), name="admit"),
        ]

    async def _follow_versions(self) -> None:
        """v: the newest version announced, once served. Never lower."""
        if self.config.promotion.enabled:
            return await self._follow_registry()
        async with httpx.AsyncClient(base_url=self.endpoint, timeout=10) as http:
            async for update in self.bus.follow(WEIGHTS_SUBJECT, newest_only=True):
                if update.version > self.version:
                    await self._until_served(http, update.version)
                    self._advance(update.version)

    async def _follow_registry(self) -> None:
        """Under promotion, v is the version that serves everyone (the trainer keeps pace with
        it, docs/promotion.md), plus every version above it the trainer abandoned: the samples
        those were trained on count as accepted, and without them back in the bound a gate that
        rejected η + 1 candidates stopped the rollout for good (the trainer, sent back to the
        serving version, waited for samples the bound would not admit). Read again whenever the
        routing or the trainer's directive (written on each rejection and rollback) changes.
        Never lower: after a rollback the trainer's staleness, not this bound, drops what is too old."""
        registry = await Registry.open(self.bus)
        changed = asyncio.Event()

        async def watch(subject: str) -> None:
            async for _ in self.bus.follow(subject, newest_only=True):
                changed.set()

        async def track() -> None:
            served = 0
            async with httpx.AsyncClient(base_url=self.endpoint, timeout=10) as http:
                while True:
                    await changed.wait()
                    changed.clear()
                    routing = await registry.routing()
                    if routing is None:
                        continue
                    serving = routing.serving.version
                    if serving > served:
                        await self._until_served(http, serving)
                        served = serving
                    self._advance(serving + abandoned_above(await registry.versions(above=serving), serving))

        await together(watch(ROUTING_SUBJECT), watch(DIRECTIVE_SUBJECT), track())  # one that fails ends them, `repeat` starts over

    def _advance(self, version: int) -> None:
        if version > self.version:
            self.version = version
            self._changed.set()

    async def _until_served(self, http: httpx.AsyncClient, version: int) -> None:
        """Wait until the endpoint serves `version` (its `/health` reports it): announced, it is
        still being loaded, and an episode admitted meanwhile would run on the version before (at
        η = 0 the trainer drops it as stale, and its admission slot never comes back). An endpoint
        that does not report its version, or does not reach this one in `SERVED_WAIT_S`, is not
        waited for (behind a balancer, one of its gateways answers)."""
        deadline = time.monotonic() + SERVED_WAIT_S
        while time.monotonic() < deadline:
            try:
                served = (await http.get("/health")).json().get("weight_version")
            except (httpx.HTTPError, ValueError, AttributeError):
                return
            if not isinstance(served, int) or served >= version:
                return
            await asyncio.sleep(0.02)
        log.warning("the endpoint still does not serve v%d after %.0f s; admitting for it anyway", version, SERVED_WAIT_S)

    async def _admit(self) -> None:
        n = self.config.rollout.sampling.n_samples
        while True:
            while not self.capacity(n):
                self._changed.clear()
                await self._changed.wait()
            task = self.env.reset(self.rng)
            lengths = [self.draw_length() if self.config.rollout.sampling.length_tail is not None else None for _ in range(n)]
            self.tasks_drawn += 1
            self.running += n
            self._save_state()
            group = asyncio.create_task(self._run_group(task, lengths))
            self._groups.add(group)
            group.add_done_callback(self._groups.discard)

    def draw_length(self) -> int:
        """A heavy-tailed generation length (`rollout.sampling.length_tail`): inverse-CDF sampling of a
        Pareto tail truncated to [min_new_tokens, max_new_tokens]."""
        g = self.config.rollout.sampling
        lo, hi, alpha = g.min_new_tokens, max(g.min_new_tokens, g.max_new_tokens), g.length_tail
        u = self.length_rng.random()
        tail = 1.0 - u * (1.0 - (lo / hi) ** alpha)
        return min(hi, int(lo / tail ** (1.0 / alpha)))

    def _save_state(self) -> None:
        state = {"tasks_drawn": self.tasks_drawn, "rng": self.rng.getstate(), "length_rng": self.length_rng.getstate(),
                 "accepted": self.accepted, "failed": self.failed}
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    def _restore(self, state: dict[str, Any]) -> None:
        self.rng.setstate(_rng_state(state["rng"]))
        self.tasks_drawn = state["tasks_drawn"]
        # A file written before the driver kept its counters and length RNG has only the above.
        if "length_rng" in state:
            self.length_rng.setstate(_rng_state(state["length_rng"]))
        self.accepted = state.get("accepted", 0)
        self.failed = state.get("failed", 0)

    async def _run_group(self, task: Task, lengths: list[int | None]) -> None:
        """A group's episodes; its slots stay in `running` until the last ends, then its
        reported verdicts move to `accepted` (a group cut short by the driver's death: neither)."""
        ended = await asyncio.gather(*(self._run_one(task, k, length) for k, length in enumerate(lengths)))
        self.running -= len(lengths)
        self.accepted += sum(ended)
        self._save_state()
        self._changed.set()

    async def _run_one(self, task: Task, k: int, length: int | None) -> bool:
        """One episode; `length`: its drawn generation length (`rollout.sampling.length_tail`), else None.
        Whether its verdict was reported."""
        session_id = f"{task.id}-{k}-{uuid.uuid4().hex[:8]}"
        turn: dict = {} if length is None else {"turn_length": length, "extra_body": {"ignore_eos": True}}
        try:
            result = await self.runner.run(task, session_id, **turn)
        except Exception as exc:
            self.failed += 1
            log.warning("rollout %s failed: %s", session_id, exc)
            return False
        if result.reward is None:
            self.failed += 1
            return False
        self.recent_rewards.append(result.reward)
        self.recent_turns.append(result.turns)
        return True

    async def stop(self) -> None:
        await cancel_and_wait([*self._tasks, *self._groups])
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
