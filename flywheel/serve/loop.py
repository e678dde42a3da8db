"""The serve loop: engines, the gateway on HTTP, turn recording, and hot swaps.

The engines are one embedded engine in this process, the external ones in `serve.engine_urls`
(SGLang, or `flywheel engine`), or vLLM servers (`serve.engine_kind: vllm`: the
`engine_urls`, else one this loop starts and stops, flywheel/serve/backends/vllm_server.py). Weight announcements are followed
from the bus (starting with the newest one, so a restarted server comes back on the current
policy) and rolled across the engines (`EnginePool.swap`, in `serve.swap_mode`) while the
gateway keeps answering. Under promotion (`promotion.mode` not off) the gateway follows the
registry's routing instead: the version that serves, and a canary's (flywheel/serve/routing.py).
Tenants changed at run time, and tenants or users forgotten, are followed from the bus too, and
with `memory.enabled` each person's instructions (flywheel/serve/served_memory.py).
With `adapters.kind: lora` announcements of LoRA adapters' versions (`WeightUpdate.adapter`) are
loaded into every engine, apart from the shared weights (`_follow_weights`), and the gateway
routes each request to its adapter (flywheel/serve/adapter_routing.py); under promotion too, the
shared and tenant adapters' versions come from the routing instead, once they passed the gate
(`Routing.adapters`), and only end users' own adapters from the announcements.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
import uvicorn

from flywheel.bus import WEIGHTS_SUBJECT, Bus, WeightUpdate, addresses
from flywheel.bus.addresses import write_address
from flywheel.bus.records import AuditEntry
from flywheel.bus.streams import AUDIT, AUDIT_SUBJECT, MEMORY_SUBJECTS, ROUTING_SUBJECT, TRAFFIC
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.config.serve import ServeConfig
from flywheel.config.tenants import retention_s
from flywheel.models import load_model, load_weights, place
from flywheel.models.adapter_store import DROPPED
from flywheel.runtime import cancel_and_wait, repeat
from flywheel.serve.adapter_loading import AdapterLoading
from flywheel.serve.adapter_routing import AdapterRouting
from flywheel.serve.backends.in_process import InProcessEngineClient
from flywheel.serve.backends.pool import EnginePool
from flywheel.serve.backends.sglang import HTTPEngineClient
from flywheel.serve.backends.vllm import VLLMEngineClient
from flywheel.serve.backends.vllm_server import uses_vllm, vllm_engines
from flywheel.serve.engine import Engine, torch_threads
from flywheel.serve.gateway import create_gateway
from flywheel.serve.ops.metrics import ServeMetrics
from flywheel.serve.ops.adapter_routes import install_adapter_routes
from flywheel.serve.ops.memory_routes import install_memory_routes
from flywheel.serve.ops.tenant_routes import install_tenant_routes
from flywheel.serve.ops.tenants import TenantDirectory
from flywheel.serve.ops.version_routes import VersionBoard
from flywheel.serve.practice import install_practice_route
from flywheel.serve.recorder import Recorder
from flywheel.serve.routing import RoutedPool
from flywheel.serve.served_memory import ServedMemory
from flywheel.tenants.forgotten import BEGUN, FORGETTING
from flywheel.tenants.registry import TenantRegistry
from flywheel.tenants.sessions import SessionRegistry
from flywheel.versions.records import Arm, Routing
from flywheel.versions.registry import Registry

log = logging.getLogger(__name__)


class ServeLoop:
    def __init__(self, config: FlywheelConfig, bus_url: str):
        self.config = config
        self.bus_url = bus_url
        self.url: str | None = None
        self.swaps = 0
        self.pauses: list[float] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> str:
        """Start the engines and the gateway; returns the gateway's base URL."""
        cfg = self.config.serve
        embedded = not (uses_vllm(self.config) or cfg.engine_urls)
        if embedded:  # the embedded engine computes here; external engines elsewhere
            torch.set_num_threads(torch_threads(cfg.torch_threads))
        model, tokenizer = await asyncio.to_thread(load_model, self.config.model, getattr(torch, cfg.dtype))
        if cfg.chat_template is not None:
            tokenizer.chat_template = cfg.chat_template
        self.engine: Engine | None = None
        self.vllm_server = None
        if uses_vllm(self.config):
            del model  # vLLM holds the weights (a server started here, or the engine_urls)
            engines, context_length, self.vllm_server = await vllm_engines(self.config)
        elif not embedded:
            del model  # external engines hold the weights; the gateway needs the tokenizer only
            engines = [await HTTPEngineClient(url, admin_key=cfg.admin_key).connect() for url in cfg.engine_urls]
            context_length = tokenizer.model_max_length if tokenizer.model_max_length < 10**8 else 2048
        else:
            try:
                model = place(model, cfg.device)
            except ValueError as exc:
                raise ConfigError(f"serve.device: {exc}") from None
            self.engine = embedded_engine(model, tokenizer, cfg)
            engines = [InProcessEngineClient(self.engine)]
            context_length = self.engine.context_length
        self.routed = cfg.role == "policy" and self.config.promotion.enabled
        self.pool = RoutedPool(engines, frozen=self.config.adapters.kind == "lora") if self.routed else EnginePool(engines)
        self.bus = await Bus.connect(self.bus_url, name="serve", replicas=self.config.bus.replicas,
                                  retention=retention_s(self.config.tenants))
        spill_dir = Path(cfg.spill_dir) if cfg.spill_dir else Path(self.config.run_dir) / "spill"
        self.recorder = Recorder(self.bus, cfg.publish_queue_size, spill_dir=spill_dir)
        self.metrics = ServeMetrics()
        if self.engine is not None:
            engine = self.engine
            self.metrics.on_scrape(lambda m: m.engine_state(**_engine_state(engine)))
        sessions = await SessionRegistry.open(self.bus, TRAFFIC.max_age_s)
        self.tenants = TenantDirectory.from_config(self.config)
        self.tenant_registry = await TenantRegistry.open(self.bus)
        for entry in await self.tenant_registry.current():  # before the first request: a revoked key opens nothing
            self.tenants.apply(entry)
        self._audit_read = await self.bus.last_seq(AUDIT.name)  # forgets from here on reach what is read next
        self.adapters = AdapterLoading(self.pool, self.config.run_dir, self.routed)
        if personal := self.config.adapters.kind == "lora" and cfg.role == "policy":  # a judge's or the gate's: the base
            await self.adapters.load_stored()
            routing = await (await Registry.open(self.bus)).routing() if self.routed else None
            if routing is not None:  # before the first request, as the stored ones
                await self.adapters.take_routed(routing)
        self.memory, self._memory_read = (await ServedMemory.read(self.bus, self.config)
                                          if self.config.memory.enabled and cfg.role == "policy" else (None, 0))
        self.app = create_gateway(self.pool, tokenizer, self.recorder, self.model_name, cfg, context_length, self.metrics,
                                  self.tenants, sessions, self._adapter_routing(), teaches=self.config.base_teaches,
                                  memory=self.memory)
        if self.config.judge.teacher.practice and cfg.role == "policy":
            install_practice_route(self.app, self.pool, self._adapter_routing(), self.tenants, self.model_name)
        install_tenant_routes(self.app, self.tenants, self.tenant_registry, cfg.admin_key, [spill_dir],
                              Path(self.config.run_dir) / "trained.jsonl")
        install_adapter_routes(self.app, self.bus, self.adapters if personal else None, cfg.admin_key)
        install_memory_routes(self.app, self.bus, self.memory, cfg.admin_key)
        self.board: VersionBoard | None = None
        if self.routed:
            assert isinstance(self.pool, RoutedPool)
            self.board = VersionBoard(self.bus, await Registry.open(self.bus), self.metrics, self.pool.arms.counts)
            self.board.install(self.app)
        # The model, tokenizer and libraries live as long as the server: take them out of the
        # collector's generations, or every full collection walks them all (~0.2 s for tiny). No
        # collection first: at this point one found 276 unreachable objects (tiny; 227 for SmolLM2,
        # with or without adapters) and freed no memory, for 0.26-0.42 s of CPU, and in a process
        # that starts many servers (the tests' workers) it walked the whole process each time.
        gc.freeze()
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, host=cfg.host, port=cfg.port, log_level="warning", lifespan="off",
            timeout_graceful_shutdown=cfg.shutdown_grace_s, timeout_keep_alive=cfg.keep_alive_s,
        ))
        self._http = asyncio.create_task(self._serve(), name="http")
        self._tasks = [asyncio.create_task(self.recorder.run(), name="recorder"), self._http,
                       asyncio.create_task(repeat(self._follow_tenants, "flywheel.serve.tenants"), name="tenants"),
                       asyncio.create_task(repeat(self._follow_forgetting, "flywheel.serve.forget"), name="forget")]
        if self.memory is not None:
            self._tasks.append(asyncio.create_task(repeat(self._follow_memory, "flywheel.serve.memory"), name="memory"))
        if self.board is not None:
            self._tasks.append(asyncio.create_task(repeat(self._follow_routing, "flywheel.serve.routing"), name="routing"))
            self._tasks.append(asyncio.create_task(self.board.refresh_forever(), name="versions"))
        if cfg.role == "policy" and (self.board is None or self.config.adapters.kind == "lora"):
            # a judge's weights do not move; the gate's move when it says; users' own adapters as announced
            self._tasks.append(asyncio.create_task(repeat(self._follow_weights, "serve.weights"), name="weights"))
        while not self._server.started:
            if self._http.done():  # it could not start: what did stopped, then the reason raised
                await self.stop()
                self._http.result()
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{cfg.host}:{port}"
        address = {"policy": addresses.SERVE, "judge": addresses.JUDGE, "eval": addresses.EVAL}[cfg.role]
        write_address(self.config.run_dir, address, self.url)
        log.info("serving %s at %s", self.model_name, self.url)
        return self.url

    async def _serve(self) -> None:
        """uvicorn's server, whose failure to listen (it logs why and exits) raises a `ConfigError`:
        a SystemExit raised in a task stops the whole event loop it runs in."""
        try:
            await self._server.serve()
        except SystemExit as exc:
            cfg = self.config.serve
            raise ConfigError(f"serve.host, serve.port: cannot listen on {cfg.host}:{cfg.port}: "
                              f"{exc.__context__ or 'see the log'}") from None

    def _adapter_routing(self) -> AdapterRouting:
        """Adapters answer a policy server's requests; a judge or eval server's are the bare
        base's (the frozen judge and teacher; the gate compares shared versions)."""
        return AdapterRouting(self.model_name, self.pool, self.config if self.config.serve.role == "policy" else None)

    @property
    def model_name(self) -> str:
        return self.config.served_model

    async def _follow_weights(self) -> None:
        """Weight announcements. The shared weights' (`adapter` None) are swapped in when newer
        than the pool's version (`EnginePool.swap`); an adapter's (`adapters.kind: lora`) is loaded
        into every engine when newer than that adapter's own version (`EnginePool.load_adapter`)
        and never compared with, nor taken for, the shared weights'. Under `kind: none` only the
        newest of a backlog counts (it supersedes the rest) and adapter announcements are ignored.
        Under `lora` every announcement the stream holds is read, from the first (a restarted
        server must find each adapter's newest version, not only the newest announcement), and of
        those that arrive together the newest of the shared weights' and of each adapter's count.
        Under promotion only end users' own adapters are taken from here
        (flywheel/serve/adapter_loading.py)."""
        if self.config.adapters.kind != "lora":
            async for update in self.bus.follow(WEIGHTS_SUBJECT, newest_only=True):
                assert isinstance(update, WeightUpdate)
                if update.adapter is not None:
                    log.warning("ignoring adapter %s v%d: adapters.kind is none", update.adapter, update.version)
                    continue
                await self._take_weights(update)
            return
        async with contextlib.aclosing(_batches(self.bus.follow(WEIGHTS_SUBJECT, from_first=True))) as batches:
            async for batch in batches:
                for update in _newest(batch):
                    if update.adapter is None:
                        if not self.routed:
                            await self._take_weights(update)
                    else:
                        await self.adapters.take(update)

    async def _take_weights(self, update: WeightUpdate) -> None:
        """Swap the shared weights to `update` (or follow the gateway that swaps) if it is newer."""
        if update.version <= self.pool.weight_version:
            return
        try:
            if not self.config.serve.swap_weights:
                await self.pool.follow(update.version, self.config.serve.follow_timeout_s)
                return
            pauses = await self.pool.swap(update.path, update.version, self.config.serve.swap_mode)
            for seconds in pauses:
                self.metrics.swap(seconds)
            self.pauses += pauses
            self.swaps += 1
        except Exception:
            log.exception("could not load weights v%d from %s", update.version, update.path)

    async def _follow_tenants(self) -> None:
        """Tenants and keys changed at run time, at any gateway, hold here too."""
        async for entry in self.tenant_registry.entries():
            self.tenants.apply(entry)

    async def _follow_forgetting(self) -> None:
        """A tenant or user forgotten anywhere (`flywheel forget`, any gateway's admin route) is
        forgotten here too: session continuations, stored responses, instructions (`memory`, also
        cleared alone); its LoRA adapters (`adapter_store.owned_by`) leave every engine, so the user's
        next request is a new user's (version 0), and again once the trainer dropped them
        (`forget.adapters`): a version a step under way published meanwhile goes too. Followed from
        before the start read adapters and instructions, after a fault from the last entry taken."""
        async for entry in self.bus.follow(AUDIT_SUBJECT, after_seq=self._audit_read,
                                           on_seq=lambda seq: setattr(self, "_audit_read", seq)):
            assert isinstance(entry, AuditEntry)
            if self.memory is not None:
                self.memory.hear(entry)
            if entry.action not in (*FORGETTING, DROPPED):
                continue
            tenant, user = entry.details["tenant"], entry.details.get("user")
            if entry.action in FORGETTING:  # from when it begins: their requests under way are not recorded
                self.app.state.forget_cached(tenant, user, entry.created_at)
            if entry.action != BEGUN:
                await self.adapters.forget(tenant, user)

    async def _follow_memory(self) -> None:
        """Every person's newest instructions, after those read before the first request."""
        async for record in self.bus.follow(MEMORY_SUBJECTS, after_seq=self._memory_read):
            self.memory.take(record)

    async def _follow_routing(self) -> None:
        async for routing in self.bus.follow(ROUTING_SUBJECT, newest_only=True):
            assert isinstance(routing, Routing) and isinstance(self.pool, RoutedPool) and self.board is not None
            self.pool.routing = routing
            with contextlib.suppress(Exception):
                await self.board.refresh()
            try:
                await self._load(self.pool, routing.serving)
                if routing.canary is not None:
                    if self.pool.canary is None:
                        self.pool.canary = EnginePool(await self._canary_engines())
                    await self._load(self.pool.canary, routing.canary)
            except Exception:
                log.exception("could not follow the routing %s (%s)", routing.id, routing.reason)
            await self.adapters.take_routed(routing)

    async def _load(self, pool: EnginePool, arm: Arm) -> None:
        """Swap `pool` to the arm's version, older or newer (`None` path: the starting weights)."""
        if pool.weight_version == arm.version:
            return
        pauses = await pool.swap(arm.path or self.config.model, arm.version, self.config.serve.swap_mode, only_newer=False)
        for seconds in pauses:
            self.metrics.swap(seconds)
        self.pauses += pauses
        self.swaps += 1

    async def _canary_engines(self) -> list:
        """The canary's engines: `promotion.canary.engine_urls` (clients of `serve.engine_kind`), else
        a second embedded engine."""
        cfg = self.config.serve
        urls = self.config.promotion.canary.engine_urls
        if urls:
            client = VLLMEngineClient if cfg.engine_kind == "vllm" else HTTPEngineClient
            return [await client(url, admin_key=cfg.admin_key).connect() for url in urls]
        model, tokenizer = await asyncio.to_thread(load_model, self.config.model, getattr(torch, cfg.dtype))
        if cfg.chat_template is not None:
            tokenizer.chat_template = cfg.chat_template
        self.canary_engine = embedded_engine(place(model, cfg.device), tokenizer, cfg)
        return [InProcessEngineClient(self.canary_engine, name="canary")]

    async def stop(self) -> None:
        """Stop taking requests, let in-flight ones finish (up to `serve.shutdown_grace_s`),
        publish what was recorded (what cannot be published now stays in the spill dir)."""
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._http, self.config.serve.shutdown_grace_s + 5)
        with contextlib.suppress(Exception):
            await self.recorder.flush(timeout_s=5)
        await cancel_and_wait(self._tasks)
        self.app.state.prompts.close()
        await self.pool.close()
        if self.vllm_server is not None:
            await asyncio.to_thread(self.vllm_server.stop)
        for engine in (self.engine, getattr(self, "canary_engine", None)):
            if engine is not None:
                engine.stop()
        await self.bus.close()
        gc.unfreeze()  # what this server froze may be collected again

    def stats(self) -> dict[str, Any]:
        gateway = self.app.state.stats
        return {
            "url": self.url,
            "version": self.pool.weight_version,
            "adapters": dict(self.pool.adapter_versions),
            "requests": gateway.requests,
            "turns": gateway.turns,
            "feedback": gateway.feedback,
            "published": self.recorder.published,
            "dropped": self.recorder.dropped,
            "spilled": self.recorder.spilled,
            "swaps": self.swaps,
            "engine": dict(self.engine.stats) if self.engine else None,
            "last_pause_s": self.pauses[-1] if self.pauses else None,
            "people_remembered": None if self.memory is None else len(self.memory),
            "instructions_taken": None if self.memory is None else self.memory.taken,
        }


def _newest(updates: list[WeightUpdate]) -> list[WeightUpdate]:
    """Of announcements that arrived together, in order: the newest (highest version, the later
    of equals) of the shared weights' and of each adapter's; only newer versions are taken anyway."""
    newest: dict[str | None, WeightUpdate] = {}
    for update in updates:
        if update.adapter not in newest or update.version >= newest[update.adapter].version:
            newest[update.adapter] = update
    return [update for update in updates if newest[update.adapter] is update]


async def _batches(records: AsyncIterator[Any], settle_s: float = 0.05) -> AsyncIterator[list[Any]]:
    """`records` in batches: each of what arrived by `settle_s` after the first of them."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        async for record in records:
            queue.put_nowait(record)

    task = asyncio.create_task(pump(), name="weights-pump")
    try:
        while True:
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                task.result()  # the reason the follow ended, if it failed
                return
            batch = [get.result()]
            await asyncio.sleep(settle_s)
            while not queue.empty():
                batch.append(queue.get_nowait())
            yield batch
    finally:
        await cancel_and_wait([task])


def embedded_engine(model: torch.nn.Module, tokenizer: Any, cfg: ServeConfig) -> Engine:
    """A started embedded engine over `model` (already placed), as `serve` configures it."""
    return Engine(model, tokenizer, max_batch_size=cfg.max_batch_size, load_weights=load_weights,
                  chunked_prefill_size=cfg.chunked_prefill_size, schedule_policy=cfg.schedule_policy,
                  max_stall_s=cfg.max_stall_s, own_decoder=cfg.own_decoder, max_loras=cfg.max_loras,
                  lora_root=cfg.lora_root, cuda_graphs=cfg.cuda_graphs).start()


def _engine_state(engine: Engine) -> dict[str, Any]:
    load = engine.load()
    return {
        "batch_size": load["num_running_reqs"],
        "waiting": load["num_waiting_reqs"],
        "kv_tokens": load["cached_tokens"],
        "kv_capacity_tokens": load["cache_slots"] or None,
    }
