"""The versions, seen and steered from the gateway (`promotion.mode` not off).

- `GET /dashboard`: one static page (flywheel/serve/ops/dashboard.html, no build step) that polls
  `GET /dashboard.json` (the registry as JSON: every version, its state and transitions, its
  gate report and online reward per 15 s, and the routing; with adapters, each shared or tenant
  adapter's versions too, under `adapters`) and draws the versions' online reward over time.
- Admin API (admin key when `serve.admin_key` is set, like the engines' control routes):
  `GET /admin/versions`, `GET /admin/versions/{N}`, `POST /admin/versions/{N}/promote`,
  `POST /admin/versions/{N}/pin`, `POST /admin/versions/unpin`, `POST /admin/versions/rollback`
  (`{"version": N}` or `{}`; optional `"reason"`). A command answers 200 with the promotion
  loop's result, 409 when the loop refused it, 504 when no promotion loop answered.
- Prometheus, per line of versions (`line`: "" for the shared weights, else a shared or tenant
  adapter's name): `flywheel_version_state{line,version,state}` (1 for each version's state),
  `flywheel_version_online_reward{line,version}` and `flywheel_version_online_sessions{line,version}`,
  `flywheel_canary_share{line}` (each line with a canary; the shared line always, 0 without one)
  and `flywheel_routed_sessions{line,arm}` (new sessions this gateway sent to each arm while the
  line's canary ran).

The snapshot the page and metrics show is refreshed whenever the routing changes and every
`REFRESH_S` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from prometheus_client import Gauge
from pydantic import BaseModel

from flywheel.serve.api.errors import APIError
from flywheel.serve.ops.metrics import ServeMetrics
from flywheel.serve.routing import WEIGHTS
from flywheel.versions.records import Routing, VersionEntry, registry_json
from flywheel.versions.registry import Registry, send_command

log = logging.getLogger(__name__)
REFRESH_S = 15.0
PAGE = Path(__file__).with_name("dashboard.html")


class RollbackRequest(BaseModel):
    version: int | None = None
    reason: str = ""
    adapter: str | None = None


class VersionBoard:
    def __init__(self, bus: Any, registry: Registry, metrics: ServeMetrics, routed: dict[tuple[str, str], int]):
        self.bus = bus
        self.registry = registry
        self.entries: list[VersionEntry] = []
        self.adapters: dict[str, list[VersionEntry]] = {}
        self.routing: Routing | None = None
        r = metrics.registry
        line = ["line", "version"]
        self._state = Gauge("flywheel_version_state", "1 for each version's registry state.", [*line, "state"], registry=r)
        self._reward = Gauge("flywheel_version_online_reward", "Mean judged reward of a version's sessions.", line,
                             registry=r)
        self._sessions = Gauge("flywheel_version_online_sessions", "Judged sessions a version sampled.", line, registry=r)
        self._share = Gauge("flywheel_canary_share", "Share of a line's new sessions sent to its canary (0: none).",
                            ["line"], registry=r)
        self._routed = Gauge("flywheel_routed_sessions", "New sessions this gateway sent to each arm of a line.",
                             ["line", "arm"], registry=r)
        self.routed_counts = routed
        metrics.on_scrape(lambda _: self._report())

    async def refresh(self) -> None:
        self.entries = await self.registry.versions()
        self.adapters = {name: await self.registry.versions(adapter=name) for name in await self.registry.adapters()}
        self.routing = await self.registry.routing()

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # the bus away: the page shows the last snapshot
                log.warning("could not read the version registry: %s", exc)
            await asyncio.sleep(REFRESH_S)

    def _report(self) -> None:
        for gauge in (self._state, self._reward, self._sessions):
            gauge.clear()
        for line, entries in ((WEIGHTS, self.entries), *self.adapters.items()):
            for entry in entries:
                self._state.labels(line, str(entry.version), entry.state).set(1)
                sessions, reward = entry.online_reward()
                self._sessions.labels(line, str(entry.version)).set(sessions)
                if reward is not None:
                    self._reward.labels(line, str(entry.version)).set(reward)
        self._share.clear()
        routing = self.routing
        self._share.labels(WEIGHTS).set(routing.canary_share if routing and routing.canary else 0.0)
        for adapter in routing.adapter_canaries if routing else ():
            self._share.labels(adapter).set(routing.canary_share)
        for (line, arm), count in self.routed_counts.items():
            self._routed.labels(line, arm).set(count)

    def install(self, app: FastAPI) -> None:
        @app.get("/dashboard", include_in_schema=False)
        async def dashboard() -> HTMLResponse:
            return HTMLResponse(PAGE.read_text())

        @app.get("/dashboard.json")
        async def dashboard_json() -> dict[str, Any]:
            return registry_json(self.entries, self.routing, self.adapters)

        @app.get("/admin/versions")
        async def versions() -> dict[str, Any]:
            await self.refresh()
            return registry_json(self.entries, self.routing, self.adapters)

        @app.get("/admin/versions/{version}")
        async def version(version: int, adapter: str | None = None) -> dict[str, Any]:
            entry = await self.registry.get(version, adapter)
            if entry is None:
                raise APIError(404, f"no version {version} {'of ' + adapter + ' ' if adapter else ''}in the registry",
                               code="not_found")
            return registry_json([entry], None)["versions"][0]

        async def command(kind: str, version: int | None = None, reason: str = "", adapter: str | None = None) -> dict[str, Any]:
            try:
                result = await send_command(self.bus, self.registry, kind, version, reason=reason, operator="admin-api",
                                            adapter=adapter)
            except TimeoutError as exc:
                raise APIError(504, str(exc), code="no_promotion_loop") from None
            if not result.ok:
                raise APIError(409, result.message, code="refused")
            await self.refresh()
            return {"ok": True, "message": result.message}

        @app.post("/admin/versions/{version}/promote")
        async def promote(version: int, adapter: str | None = None) -> dict[str, Any]:
            return await command("promote", version, adapter=adapter)

        @app.post("/admin/versions/{version}/pin")
        async def pin(version: int, adapter: str | None = None) -> dict[str, Any]:
            return await command("pin", version, adapter=adapter)

        @app.post("/admin/versions/unpin")
        async def unpin(adapter: str | None = None) -> dict[str, Any]:
            return await command("unpin", adapter=adapter)

        @app.post("/admin/versions/rollback")
        async def rollback(body: RollbackRequest) -> dict[str, Any]:
            return await command("rollback", body.version, body.reason, body.adapter)
