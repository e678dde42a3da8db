"""The fault drill: the loops as processes on one bus (`cluster.Cluster`), agents talking to the
gateways (`agents.agents`), kill -9 of each victim in turn under that load, each restarted, and
the audit (`audit.audit`) once everything has settled. `python -m bench.fault_drill` runs it for
each component; tests/test_fault_drills.py runs small ones."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import nats

from flywheel.drills.agents import agents
from flywheel.drills.audit import FAILURES as AUDIT_FAILURES
from flywheel.drills.audit import audit
from flywheel.drills.cluster import Cluster

LOOPS = ("collect", "judge", "train")
"""The loops a drill starts beside its gateways."""
FAILURES = (*AUDIT_FAILURES, "engine_duplicate_loads")
"""The counts of a drill's report that must be 0."""
BATCH = 8
DRILL_CONFIG = [
    "bus.ack_wait_s=3", "collect.feedback_grace_s=1", f"train.batch_size={BATCH}", "train.group_timeout_s=30",
    "train.checkpoint_interval=3", "rollout.max_head_offpolicyness=1000", "serve.max_batch_size=16",
    "judge.teacher.enabled=false",
]
"""Short waits so a drill takes seconds; no staleness drops, so every sample must be trained; the
agents' feedback is rewards without words, so no hint teacher (nor its server). The
group timeout is long enough for a group's last member to come back from redelivery or the
gateway's spill file after a kill: a group split by its timeout leaves a partial batch behind."""


async def drill(run_dir: Path, victims: list[str], turns: int = 3, concurrency: int = 8, group_size: int = 4,
                every_s: float = 3.0, down_s: float = 1.5, settle_s: float = 90.0, nats_nodes: int = 1,
                gateways: int = 1, by_session: bool = False, engines: int = 0, min_sessions: int = 0) -> dict[str, Any]:
    """Start the cluster, put it under the agents' load, kill -9 each victim in turn (`every_s`
    apart, down for `down_s`, then restarted and back), keep the load on for `every_s` more and
    until `min_sessions` sessions have ended, and audit once everything has settled."""
    cluster = Cluster(run_dir, DRILL_CONFIG, nats_nodes, gateways, engines)
    cluster.start_nats()
    try:
        for kind in cluster.engine_ports:
            cluster.start(kind)
        await cluster.wait_serving(urls=cluster.engine_urls)
        for kind in (*cluster.gateways, *LOOPS):
            cluster.start(kind)
        await cluster.wait_serving()
        started = time.monotonic()
        stop = asyncio.Event()
        load_task = asyncio.create_task(agents(cluster.serve_urls, stop, turns, concurrency, group_size, BATCH,
                                                by_session=by_session, min_sessions=min_sessions))
        for victim in victims:
            await asyncio.sleep(every_s)
            cluster.kill(victim)
            await asyncio.sleep(down_s)
            cluster.restart(victim)
            await cluster.back(victim)
        await asyncio.sleep(every_s)
        stop.set()
        load = await load_task
        load_s = time.monotonic() - started
        deadline = time.monotonic() + settle_s
        audit_retries = 0
        while True:  # until every answered session is trained (all groups fill: nothing is left waiting)
            try:
                report = await audit(cluster.bus_url, run_dir, load, turns)
            except nats.errors.Error:  # a JetStream API request refused or unanswered while the cluster settles
                audit_retries += 1
                await asyncio.sleep(1.0)
                continue
            if report["trained"] >= len(load.answered) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        loads = cluster.engine_loads()
        return {"victims": victims, "load_s": round(load_s, 1), "settled_s": round(time.monotonic() - started, 1),
                "alive": cluster.alive(), "audit_retries": audit_retries, **report,
                "engine_loads": {kind: len(versions) for kind, versions in loads.items()},
                "engine_last_version": {kind: versions[-1] if versions else "0" for kind, versions in loads.items()},
                "engine_duplicate_loads": sum(len(v) - len(set(v)) for v in loads.values())}
    finally:
        cluster.stop()
