"""A running Flywheel: the bus plus the loops hosted as Ray actors.

    with Deployment(config) as deployment:
        deployment.stats()   # every loop's counters

Starting: the bus (an embedded nats-server unless `bus.url` names one), Ray (local unless
`deploy.ray_address` names a cluster), then the loops of `deploy.loops` (serve, collect, judge,
train), each placed by `deploy.resources`, and, when `rollout.enabled`, the rollout driver
pointed at serve's URL (or `rollout.endpoint`). With `promotion.mode` not off, `promote` in the
loops starts the promotion loop with its evaluation server (`eval_serve`, `serve.role: eval`);
the judge's own server starts when the judge needs one or the gate has a traffic suite (its
pinned judge). Ray restarts a loop whose process or node dies
(`flywheel.deploy.actors`). Stopping reverses that and leaves
no process behind: every loop is stopped, its actor killed, a Ray this deployment started is
shut down, and an embedded nats-server is terminated.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from flywheel.bus.embedded import EmbeddedNats, start_bus
from flywheel.config import FlywheelConfig, dump_config
from flywheel.config.placement import ray_options
from flywheel.deploy.actors import LoopActor

log = logging.getLogger(__name__)

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Only for a Ray this deployment starts itself: its node advertises the loopback address. Never
set when joining a cluster (`deploy.ray_address`), whose nodes must reach this driver."""
CALL_TIMEOUT_S = 300.0
PROGRESS_EVERY_S = 15.0


class Deployment:
    def __init__(self, config: FlywheelConfig):
        self.config = sharing_cores(config)
        self.bus_url: str | None = None
        self.serve_url: str | None = None
        self.judge_url: str | None = None
        """The judge's own server (`serve.role: judge`), when the judge needs one."""
        self.eval_url: str | None = None
        """The promotion gate's evaluation server (`serve.role: eval`), under promotion."""
        self.actors: dict[str, Any] = {}
        self._nats: EmbeddedNats | None = None
        self._owns_ray = False

    def start(self, progress: Callable[[str], None] = log.info) -> "Deployment":
        """Start everything; `progress` hears each loop come up and, while some are starting,
        which (every `PROGRESS_EVERY_S`)."""
        try:
            self._start(progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, progress: Callable[[str], None]) -> None:
        self._began = time.monotonic()
        run_dir = Path(self.config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(self.config))
        self.bus_url, self._nats = start_bus(self.config.bus.url, run_dir)
        if not ray.is_initialized():
            local = self.config.deploy.ray_address is None
            for key, value in {**RAY_ENV, **(LOCAL_RAY_ENV if local else {})}.items():
                os.environ.setdefault(key, value)
            ray.init(  # "local": never the cluster a `ray start` on this machine last wrote down
                address=self.config.deploy.ray_address or "local",
                num_cpus=self.config.deploy.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
            )
            self._owns_ray = self.config.deploy.ray_address is None
        loops = self.config.deploy.loops
        promoting = "promote" in loops and self.config.promotion.enabled
        first = {kind: self.config for kind in ("serve", "collect", "train") if kind in loops}
        if needs_judge_server(self.config):
            first["judge_serve"] = side_server_config(self.config, "judge")
        if promoting:
            first["eval_serve"] = side_server_config(self.config, "eval")
        started: dict[str, Any] = {}
        if "serve" in first and self.config.serve.engine_kind == "vllm":  # vLLM sizes itself by the memory free as it starts
            started = self._launch({"serve": first.pop("serve")}, progress)
        started |= self._launch(first, progress)  # none of these needs another's address: they start side by side
        self.serve_url, self.judge_url, self.eval_url = (started.get(k) for k in ("serve", "judge_serve", "eval_serve"))
        gateway = self.serve_url or self.config.rollout.endpoint  # gateways hosted elsewhere
        then: dict[str, FlywheelConfig] = {}
        if promoting:
            then["promote"] = promote = self.config.model_copy(deep=True)
            promote.promotion.eval_url = self.eval_url
            if promote.judge.llm.base_url is None and self.judge_url is not None:  # a traffic suite's pinned judge
                promote.judge.llm.base_url = f"{self.judge_url}/v1"
        if "judge" in loops:
            then["judge"] = judge = self.config.model_copy(deep=True)
            if judge.judge.llm.base_url is None:  # the judge reads its URL here, on whatever node it runs
                source = self.judge_url if judge.judge.llm.source == "pinned" else gateway
                judge.judge.llm.base_url = source and f"{source}/v1"
        if self.config.rollout.enabled:
            then["rollout"] = rollout = self.config.model_copy(deep=True)
            rollout.rollout.endpoint = gateway
        self._launch(then, progress)

    def _launch(self, configs: dict[str, FlywheelConfig], progress: Callable[[str], None]) -> dict[str, Any]:
        """Start each loop's actor where `deploy.resources` places it, all at once (a loop's
        process spends seconds importing torch and its model: on two cores, two at a time);
        each one's `start` result. The first to fail raises at once; `CALL_TIMEOUT_S` bounds them all."""
        refs = {}
        for kind, config in configs.items():
            placement = self.config.deploy.resources.get(kind)
            options = ray_options(placement) if placement is not None else {}
            actor = LoopActor.options(name=f"flywheel-{kind}-{os.getpid()}", **options).remote(
                kind, config.model_dump(mode="json"), self.bus_url
            )
            self.actors[kind] = actor
            refs[kind] = actor.address.remote()
        starting, began = {ref: kind for kind, ref in refs.items()}, time.monotonic()
        while starting:
            waited = time.monotonic() - began
            if waited >= CALL_TIMEOUT_S:
                raise TimeoutError(f"{', '.join(starting.values())} did not start within {CALL_TIMEOUT_S:.0f} s")
            ready, _ = ray.wait(list(starting), num_returns=1, timeout=min(PROGRESS_EVERY_S, CALL_TIMEOUT_S - waited))
            if not ready:
                progress(f"starting {', '.join(starting.values())} ({time.monotonic() - self._began:.0f} s)")
                continue
            ray.get(ready)  # a loop that failed to start raises here, as soon as it fails
            progress(f"{starting.pop(ready[0])} is up ({time.monotonic() - self._began:.0f} s)")
        return {kind: ray.get(ref) for kind, ref in refs.items()}

    def stats(self, timeout_s: float = 10.0) -> dict[str, dict[str, Any]]:
        """Each loop's counters; a loop that does not answer reports its error."""
        refs = {kind: actor.stats.remote() for kind, actor in self.actors.items()}
        out: dict[str, dict[str, Any]] = {}
        for kind, ref in refs.items():
            try:
                out[kind] = ray.get(ref, timeout=timeout_s)
            except Exception as exc:
                out[kind] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    def stop(self, timeout_s: float = CALL_TIMEOUT_S, progress: Callable[[str], None] = log.info) -> None:
        """Stop each loop (within `timeout_s`, else it is killed): traffic sources first, then the
        loops downstream of them. `progress` hears each one stop, and how long it took."""
        for kind in ("rollout", "serve", "collect", "judge", "judge_serve", "promote", "eval_serve", "train"):
            actor = self.actors.pop(kind, None)
            if actor is None:
                continue
            began = time.monotonic()
            try:
                ray.get(actor.stop.remote(), timeout=timeout_s)  # train finishes its step and checkpoints
            except Exception as exc:
                log.warning("%s did not stop cleanly: %s", kind, exc)
            ray.kill(actor)
            progress(f"{kind} stopped ({time.monotonic() - began:.0f} s)")
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
        if self._nats is not None:
            self._nats.stop()
            self._nats = None

    def __enter__(self) -> "Deployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def sharing_cores(config: FlywheelConfig) -> FlywheelConfig:
    """`config` for loops that share their machine's cores: a serve loop that does not say how many
    torch threads it takes (`serve.torch_threads`, whose default is every core, for a gateway alone
    on its machine) takes `deploy.serve_torch_threads`."""
    if config.serve.torch_threads is not None:
        return config
    config = config.model_copy(deep=True)
    config.serve.torch_threads = config.deploy.serve_torch_threads
    return config


def needs_judge_server(config: FlywheelConfig) -> bool:
    """Whether the judge's own server starts: the judge needs it (a pinned `llm` judge, the hint
    teacher unless the policy's base teaches), or the promotion gate has a traffic suite and no
    `judge.llm.base_url` to ask."""
    loops = config.deploy.loops
    gate_judge = ("promote" in loops and config.promotion.enabled and config.judge.llm.base_url is None
                  and any(suite.source == "traffic" for suite in config.promotion.gate.suites))
    return gate_judge or ("judge" in loops and config.judge.needs_server(for_teacher=not config.base_teaches))


def side_server_config(config: FlywheelConfig, role: str) -> FlywheelConfig:
    """A server beside the policy's, on a free port, its weights never following announcements:
    the judge's (`judge`: the weights in `judge.weights`, the starting model by default) or the
    promotion gate's (`eval`: the starting model, then whatever versions the gate loads, on
    `promotion.eval_torch_threads` threads)."""
    server = config.model_copy(deep=True)
    server.model = config.judge.weights or config.model if role == "judge" else config.model
    server.serve.role = role  # type: ignore[assignment]
    if role == "eval":
        server.serve.torch_threads = config.promotion.eval_torch_threads
    server.serve.port = 0
    server.serve.engine_urls = []
    server.serve.served_model_name = config.served_model
    return server
