"""The tenant drill (issue 43): four tenants with mixed consent, storage and personal-data
policies (`tenant_load.TENANTS`) under agent load through the gateway, kill -9 of the gateway and
then of the collector mid-way (each restarted), and the audit (`tenant_audit`): nothing of a
tenant that is not kept, no personal data a policy keeps out, and no sample without consent
reaches the bus, the disk or the trainer; nothing of the others is lost, duplicated or trained
twice. `python -m bench.tenant_drill` runs it at size; tests/test_tenant_drill.py runs a small one.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats

from flywheel.drills.cluster import Cluster
from flywheel.drills.fault import DRILL_CONFIG, LOOPS
from flywheel.drills.tenant_audit import FAILURES, finish_audit, tenant_audit
from flywheel.drills.tenant_load import CYCLE, KINDS, TENANTS, TenantLoad, tenant_agents

TENANT_CONFIG = [*DRILL_CONFIG, f"tenants={json.dumps(TENANTS)}"]
"""The fault drill's settings (short waits, batch 8, no staleness drops) and the four tenants."""


async def _until(condition: Callable[[], bool], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def _progress(bus_url: str, run_dir: Path) -> tuple[int, int, int]:
    """(messages on TRAJECTORIES, on SAMPLES, distinct samples in the weights' lineage)."""
    from flywheel.bus import Bus
    from flywheel.train.ledger import lineage

    bus = await Bus.connect(bus_url, name="tenant-drill-progress", ensure_streams=False)
    try:
        counts = [(await bus.js.stream_info(name)).state.messages for name in ("TRAJECTORIES", "SAMPLES")]
    finally:
        await bus.close()
    ledger = run_dir / "trained.jsonl"
    trained = {d for step in lineage(ledger) for d in step["samples"]} if ledger.exists() else set()
    return counts[0], counts[1], len(trained)


async def tenant_drill(run_dir: Path, min_sessions: int = CYCLE, concurrency: int = 8,
                       victims: tuple[str, ...] = ("serve", "collect"), down_s: float = 1.5,
                       settle_s: float = 120.0) -> dict[str, Any]:
    """Start the cluster with the four tenants, run their agents until `min_sessions` have ended
    (whole cycles of every kind), kill -9 each victim in turn once its share of them has ended
    (the gateway after a third, the collector after two thirds), restart it, let everything settle,
    read the bus, stop, and audit the bus and the run directory."""
    cluster = Cluster(run_dir, TENANT_CONFIG)
    load = TenantLoad(tag=secrets.token_hex(3))
    kills: list[dict[str, Any]] = []
    cluster.start_nats()
    try:
        for kind in ("serve", *LOOPS):
            cluster.start(kind)
        await cluster.wait_serving()
        started = time.monotonic()
        stop = asyncio.Event()
        task = asyncio.create_task(tenant_agents(cluster.serve_urls, stop, concurrency, min_sessions, load))
        for n, victim in enumerate(victims, 1):
            share = min_sessions * n // (len(victims) + 1)
            await _until(lambda: load.ended() >= share or task.done())  # noqa: B023 (awaited here)
            cluster.kill(victim)
            kills.append({"victim": victim, "sessions_ended": load.ended(), "at_s": round(time.monotonic() - started, 1)})
            await asyncio.sleep(down_s)
            cluster.restart(victim)
        stop.set()
        await task
        load_s = time.monotonic() - started
        stored = [s for s in load.sessions.values() if s.sid in load.answered]
        kinds = {kind.name: kind for kind in KINDS}
        expected_trajectories = sum(1 for s in stored if kinds[s.kind].turns > 0)
        expected_trained = sum(1 for s in stored if kinds[s.kind].trainable)
        deadline = time.monotonic() + settle_s
        progress = (0, 0, 0)
        while time.monotonic() < deadline:
            try:
                progress = await _progress(cluster.bus_url, run_dir)
            except nats.errors.Error:
                pass
            if progress[0] >= expected_trajectories and progress[1] >= expected_trajectories \
                    and progress[2] >= expected_trained:
                break
            await asyncio.sleep(1.0)
        settled_s = time.monotonic() - started
        bus_view = await tenant_audit(cluster.bus_url, load)
        alive = cluster.alive()
    finally:
        cluster.stop()
    report = finish_audit(run_dir, load, bus_view)
    return {"kills": kills, "restarts": dict(cluster.restarts), "alive": alive, "load_s": round(load_s, 1),
            "settled_s": round(settled_s, 1), "expected_trajectories": expected_trajectories,
            "expected_trained": expected_trained, **report}


def failures(report: dict[str, Any]) -> dict[str, int]:
    """The counts of a report that must be 0 and are not, and processes found dead."""
    bad = {key: report[key] for key in FAILURES if report[key]}
    dead = [name for name, up in report["alive"].items() if not up]
    return {**bad, **({"dead": len(dead)} if dead else {})}
