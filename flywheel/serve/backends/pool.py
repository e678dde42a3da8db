"""The engines behind one gateway: session-affine routing and rolling weight swaps.

Routing is rendezvous hashing of the session id over the engines' names: a session keeps going
to the same engine (its prefix cache stays warm there), and when an engine is added or removed
only the sessions that hashed to it move. Weight swaps roll across the engines one at a time
(pause in the configured mode, load, continue), so with several engines some engine is always
generating; with the embedded engine the pause lasts only as long as the load.

With several gateways in front of the same engines, one gateway swaps (`serve.swap_weights`)
and the others `follow`: they poll the engines' versions until each has the announced one, so
an engine is loaded once per version and every gateway labels its tokens right.

Versions here are Flywheel's integers: each client turns its engine's opaque label into one
(`flywheel.serve.engine_choice.version_of`: "12" is 12, a label such as "default" is 0) and sends a swap's
version to the engine as the label `str(version)`.

LoRA adapters (`adapters.kind: lora`) have versions of their own, apart from the shared weights':
`load_adapter` loads one adapter's version into every engine (no pause: the engines take it
between two steps) and only then counts it as published (`adapter_versions`), so a request sent
with that adapter finds it on whichever engine its session routes to. `unload_adapter` takes one
out of that count first (new requests go to its origin or the base at once), then out of every
engine: how a forgotten user's adapter stops serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from flywheel.serve.backends.base import EngineClient

log = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, engines: list[EngineClient]):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = engines
        self.adapter_versions: dict[str, int] = {}
        """Each adapter's version that every engine has loaded (absent: none published yet)."""

    def route(self, session_id: str) -> EngineClient:
        def score(engine: EngineClient) -> bytes:
            return hashlib.blake2b(f"{engine.name}\0{session_id}".encode(), digest_size=8).digest()

        return max(self.engines, key=score)

    @property
    def weight_version(self) -> int:
        """The version every engine has reached (the oldest one, during a rolling swap)."""
        return min(engine.weight_version for engine in self.engines)

    async def swap(self, model_path: str, version: int, mode: str = "in_place", only_newer: bool = True) -> list[float]:
        """Load `version` into every engine, one after another; returns how long each paused.
        An engine already on it, or (`only_newer`) on a newer one, is left alone."""
        paused = []
        for engine in self.engines:
            if engine.weight_version == version or only_newer and engine.weight_version > version:
                continue
            started = time.monotonic()
            await engine.pause(mode)
            try:
                await engine.update_weights_from_disk(model_path, version)
            finally:
                await engine.resume()
            paused.append(time.monotonic() - started)
            log.info("engine %s now on v%d (paused %.3fs)", engine.name, version, paused[-1])
        return paused

    async def load_adapter(self, name: str, path: str, version: int) -> None:
        """Load version `version` of adapter `name` (its PEFT directory `path`) into every engine,
        then count it as published. The shared weights' version is not touched."""
        for engine in self._adapter_engines():
            await engine.load_adapter(name, path, version)
        self.adapter_versions[name] = version
        log.info("adapter %s now on v%d", name, version)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`: no longer published here (routing sends its requests to its
        origin or the base, as a new adapter's), then unloaded from every engine."""
        self.adapter_versions.pop(name, None)
        for engine in self._adapter_engines():
            await engine.unload_adapter(name)
        log.info("adapter %s unloaded", name)

    def _adapter_engines(self) -> list[EngineClient]:
        return self.engines

    async def follow(self, version: int, timeout_s: float, poll_s: float = 0.25) -> bool:
        """Wait until every engine reports `version` or newer (another gateway swaps them),
        learning each engine's version as it changes; False if some engine has not reached it
        within `timeout_s`. Until then tokens from an engine count as the version last learned
        for it (never newer than the weights that sampled them)."""
        deadline = time.monotonic() + timeout_s
        for engine in self.engines:
            while await engine.refresh_version() < version:
                if time.monotonic() >= deadline:
                    log.warning("engine %s still on v%d, %.0fs after v%d was announced", engine.name,
                                engine.weight_version, timeout_s, version)
                    return False
                await asyncio.sleep(poll_s)
        return True

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()
