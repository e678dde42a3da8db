"""The Ray node drill: the loops placed on a real two-node Ray cluster by `deploy.resources`, then
kill -9 of the worker node hosting the trainer, under load.

Two nodes on this machine, each a `ray start --block` of its own: a head advertising `head`
(serve, collect, judge) and a worker advertising `trainer` (train). Agents run multi-turn
sessions through the gateway (`flywheel.drills.agents`); the worker node is killed with SIGKILL
(its raylet, its workers, the trainer in them) and a new node with the same `trainer` resource
joins; Ray restarts the trainer there, which resumes from its checkpoint and gets back from the
bus what its predecessor held. The audit (`flywheel.drills.audit`) counts what was lost,
truncated, duplicated or trained twice, and the 5xx the agents saw.

    python -m flywheel.drills.ray_node --out REPORT.json [--every-s 5]

A program of its own, so that it owns its Ray connection (bench/ray_node_drill.py and
tests/test_ray_cluster.py run it). It says on stderr what it has reached and when, so a drill
stopped from outside still says where it stood.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flywheel.bus.cluster import free_port
from flywheel.drills.agents import agents
from flywheel.drills.audit import FAILURES, audit
from flywheel.drills.fault import BATCH, DRILL_CONFIG

PLACEMENT = {"serve": {"head": 1}, "collect": {"head": 1}, "judge": {"head": 1}, "train": {"trainer": 1}}
NODE_RESOURCES = {"head": {"head": 100}, "trainer": {"trainer": 100}}
"""A node advertises many units of its kind's resource, so every loop placed there (1 each) fits."""
STOP_TIMEOUT_S = 20.0
"""A loop that has not stopped within this is killed with its node: the drill's measuring is done."""
FAST_FAILURE_DETECTION = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "10000",
    "RAY_health_check_failure_threshold": "5",
}
"""A killed node, whose health checks are refused at once, should be declared dead after 5 checks a
second apart, sooner than with Ray's defaults (its detection time not measured); a busy one may
take up to 10 s a check (Ray's default) before it counts as missed. With 3 s a check, at the end of
fresh clones' suites (load 10 on two cores), the drill's nodes did not join in 180 s and the
trainer did not come back in 120 s, Ray logging a node "marked dead ... missed too many heartbeats
... busy workload" (which node, and why the join failed, not seen: the nodes' logs went with the
drill's temp dir; it now prints their tails)."""


STARTED_LINE = "Ray runtime started."
"""What `ray start` prints once its node runs."""
NODE_START_S = 90.0
START_TRIES = 3


class RayNodes:
    """A Ray head and worker nodes, each `ray start --block` in its own process group."""

    def __init__(self, temp_dir: str):
        self.address = ""
        """The head's, once started."""
        self.temp_dir = temp_dir
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # multi-node, even where a local Ray was asked for loopback
                    **FAST_FAILURE_DETECTION}
        self.nodes: list[subprocess.Popen] = []

    def _start(self, args: Callable[[], list[str]], resources: dict[str, float], cpus: int) -> subprocess.Popen:
        """Start a node (`args`: its own arguments, made for each try) and return once its `ray
        start` says it runs. Ray gives a node's raylet a fixed 30 s to register with the GCS
        (`raylet_start_wait_time_s` in ray/_private/node.py) and its `ray start` exits when that
        is missed, which a loaded machine does (a fresh clone's suite, 2026-12-02: the head's start
        gave up and the drill could not connect); such a node is killed with its processes and
        started again, at most `START_TRIES` times."""
        for _ in range(START_TRIES):
            ray = str(Path(sys.executable).parent / "ray")
            log_path = Path(self.temp_dir) / f"node{len(self.nodes)}.log"
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    [ray, "start", *args(), "--node-ip-address", "127.0.0.1", "--num-cpus", str(cpus),
                     "--resources", json.dumps(resources), "--disable-usage-stats", "--block"],
                    env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
            self.nodes.append(proc)
            deadline = time.monotonic() + NODE_START_S
            while proc.poll() is None and time.monotonic() < deadline:
                if STARTED_LINE in log_path.read_text(errors="replace"):
                    return proc
                time.sleep(0.2)
            why = f"exit code {proc.poll()}" if proc.poll() is not None else f"not started in {NODE_START_S:g} s"
            reached(f"a node's `ray start` gave up ({why}); starting it again")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its GCS or raylet may outlive it
            proc.wait()
        raise RuntimeError(f"a Ray node did not start in {START_TRIES} tries:\n{self.log_tails()}")

    def start_head(self, resources: dict[str, float]) -> None:
        """Start the head (on a new port at each try: a killed one's may linger)."""
        def args() -> list[str]:
            self.address = f"127.0.0.1:{free_port()}"
            return ["--head", "--port", self.address.rsplit(":", 1)[1], "--temp-dir", self.temp_dir,
                    "--include-dashboard=false"]
        self._start(args, resources, 2)

    def log_tails(self, lines: int = 15) -> str:
        """The last `lines` of each node's `ray start` output (its log goes with the temp dir)."""
        logs = sorted(Path(self.temp_dir).glob("node*.log"))
        return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                         for log in logs)

    def start_worker(self, resources: dict[str, float]) -> subprocess.Popen:
        return self._start(lambda: ["--address", self.address], resources, 1)

    @staticmethod
    def kill(node: subprocess.Popen) -> None:
        """SIGKILL the node's whole process group: `ray start`, its raylet and every worker."""
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()

    def stop(self) -> None:
        """SIGTERM to each `ray start`, which stops its node's processes in order (2 s); SIGTERM to the
        whole group reaches the head's GCS and raylet at once, and they hang (30 s, then SIGKILL)."""
        for node in reversed(self.nodes):
            if node.poll() is None:
                os.kill(node.pid, signal.SIGTERM)
        for node in self.nodes:
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)


STARTED = time.monotonic()


def reached(what: str) -> None:
    """Say on stderr what the drill has reached, and when (seconds since it started)."""
    print(f"[ray node drill +{time.monotonic() - STARTED:.1f}s] {what}", file=sys.stderr, flush=True)


async def wait_for(condition, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = await condition()
            if value:
                return value
        except Exception:  # noqa: BLE001 - not there yet (an actor restarting, a node joining)
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g}s")
        await asyncio.sleep(0.2)


async def drill(run_dir: Path, temp_dir: str, every_s: float = 5.0, concurrency: int = 8, turns: int = 3,
                group_size: int = 4, settle_s: float = 120.0) -> dict[str, Any]:
    import ray

    from flywheel.config import load_config
    from flywheel.deploy.deployment import Deployment

    nodes = RayNodes(temp_dir)
    deployment = None
    try:
        nodes.start_head(NODE_RESOURCES["head"])
        worker = nodes.start_worker(NODE_RESOURCES["trainer"])
        ray.init(address=nodes.address, log_to_driver=False)

        async def both_nodes_up() -> bool:
            return sum(n["Alive"] for n in ray.nodes()) == 2

        await wait_for(both_nodes_up, 180, "the two nodes did not join")  # 60 s was too little on a loaded host
        reached("both nodes up")
        config = load_config(None, [
            f"run_dir={run_dir}", f"deploy.ray_address={nodes.address}", f"deploy.resources={json.dumps(PLACEMENT)}",
            "rollout.enabled=false", f"serve.port={free_port()}", *DRILL_CONFIG,
        ])
        deployment = Deployment(config).start()
        reached("deployment started")
        resources_of = {n["NodeID"]: sorted(k for k in n["Resources"] if k in ("head", "trainer")) for n in ray.nodes()}

        async def placement() -> dict[str, list[str]]:
            return {kind: resources_of.get(await actor.node_id.remote(), []) for kind, actor in deployment.actors.items()}

        placed = await placement()
        trainer = deployment.actors["train"]
        node_before = await trainer.node_id.remote()
        stop = asyncio.Event()
        started = time.monotonic()
        load_task = asyncio.create_task(agents([deployment.serve_url], stop, turns, concurrency, group_size, BATCH))
        await asyncio.sleep(every_s)
        nodes.kill(worker)
        killed_at = time.monotonic()
        await asyncio.to_thread(nodes.start_worker, NODE_RESOURCES["trainer"])  # the load goes on meanwhile
        reached("the trainer's node killed, a new one started")

        async def trainer_moved() -> bool:
            node = await trainer.node_id.remote()
            resources_of.update({n["NodeID"]: sorted(k for k in n["Resources"] if k in ("head", "trainer"))
                                 for n in ray.nodes()})
            return node != node_before

        await wait_for(trainer_moved, 240, "the trainer did not come back on the new node")  # 120 s was too little under load
        trainer_back_s = time.monotonic() - killed_at
        reached("the trainer back on the new node")
        await asyncio.sleep(every_s)
        stop.set()
        load = await load_task
        load_s = time.monotonic() - started
        reached(f"load ended: {len(load.answered)} sessions answered")
        deadline = time.monotonic() + settle_s
        while True:
            report = await audit(deployment.bus_url, run_dir, load, turns)
            if report["trained"] >= len(load.answered) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        reached(f"audited: {report['trained']} trained")
        return {"placement": placed, "placement_after": await placement(), "trainer_back_s": round(trainer_back_s, 1),
                "load_s": round(load_s, 1), "trainer_version": deployment.stats()["train"].get("version"), **report}
    except BaseException:
        print(f"the nodes' last words:\n{nodes.log_tails()}", file=sys.stderr, flush=True)
        raise
    finally:
        if deployment is not None:
            deployment.stop(timeout_s=STOP_TIMEOUT_S)
        if ray.is_initialized():
            ray.shutdown()
        nodes.stop()
        reached("stopped")


def main(default_out: Path | None = None) -> int:
    """Run the drill, write its report to `--out` (default `default_out`), and exit 0 when nothing
    was lost, duplicated or refused and every answered session was trained."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every-s", type=float, default=5.0, help="seconds of load before the kill, and after the trainer is back")
    parser.add_argument("--out", type=Path, default=default_out, required=default_out is None,
                        help="where the report goes (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flywheel-ray-drill-") as run_dir, \
            tempfile.TemporaryDirectory(prefix="rd", dir="/tmp") as temp_dir:
        report = asyncio.run(drill(Path(run_dir), temp_dir, every_s=args.every_s))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if not any(report[k] for k in FAILURES) and report["trained"] == report["sessions_answered"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
