"""The loops as processes of their own, each killable with SIGKILL and restartable: nats-server
(its data on disk, restartable on the same port) or a JetStream cluster of three
(`flywheel.bus.cluster`, every stream replicated three times), `flywheel serve` gateways,
`flywheel loop collect|judge|train|promote`, and optionally `flywheel engine` processes the
gateways share. What the drills in this package put under load and kill."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx

from flywheel.bus.cluster import LocalNatsCluster
from flywheel.bus.embedded import EmbeddedNats
from flywheel.cli import command
from flywheel.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
"""Where the processes start: the directory that holds the `flywheel` package."""


class Cluster:
    """nats-server (or a JetStream cluster of `nats_nodes` members, `bus.replicas=3`) plus the
    loops as processes, all sharing `run_dir`, with `gateways` serve processes (`serve`,
    `serve-1`, ...: each its own port and spill directory). Each gateway has its embedded
    engine, or with `engines` > 0 all share that many `flywheel engine` processes
    (`engine-0`, ...): `serve` swaps their weights, the others follow. Victims: a loop's, a
    gateway's or an engine's name, `nats` (the one server), or `nats-0`, `nats-1`, ... (cluster
    members)."""

    def __init__(self, run_dir: Path, overrides: list[str], nats_nodes: int = 1, gateways: int = 1, engines: int = 0):
        self.run_dir = run_dir
        self.gateways = ["serve"] + [f"serve-{i}" for i in range(1, gateways)]
        self.serve_ports = {name: free_port() for name in self.gateways}
        self.engine_ports = {f"engine-{i}": free_port() for i in range(engines)}
        self.engine_urls = [f"http://127.0.0.1:{port}" for port in self.engine_ports.values()]
        if nats_nodes > 1:
            self.nats = LocalNatsCluster(run_dir / "nats", nats_nodes)
            self.bus_url = self.nats.url
            overrides = [*overrides, "bus.replicas=3"]
        else:
            self.nats = EmbeddedNats(run_dir / "nats", port=free_port())
            self.bus_url = f"nats://127.0.0.1:{self.nats.port}"
        self.overrides = ["serve.torch_threads=1", *overrides]  # the loops share this machine, as a Deployment's do
        self.serve_urls = [f"http://127.0.0.1:{port}" for port in self.serve_ports.values()]
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: Counter[str] = Counter()

    def start_nats(self) -> None:
        self.nats.start()

    def start(self, kind: str) -> None:
        if kind.startswith("nats-"):
            self.nats.restart(int(kind.removeprefix("nats-")))
            return
        if kind == "nats":
            self.start_nats()
            return
        log = (self.run_dir / f"{kind}.log").open("a")
        if kind in self.engine_ports:
            args = [*command("engine"), "--port", str(self.engine_ports[kind]), "--weight-version", "0",
                    "--max-running-requests", "16", "--torch-threads", "1"]
        else:
            gateway = [f"serve.port={self.serve_ports[kind]}", f"serve.spill_dir={self.run_dir / 'spill' / kind}"] \
                if kind in self.serve_ports else []
            if kind in self.serve_ports and self.engine_urls:
                gateway += [f"serve.engine_urls={json.dumps(self.engine_urls)}", f"serve.swap_weights={kind == 'serve'}"]
            loop = kind.partition("-")[0]
            args = [*command(*(["serve"] if loop == "serve" else ["loop", loop])), f"bus.url={self.bus_url}",
                    f"run_dir={self.run_dir}", *gateway, *self.overrides]
        self.procs[kind] = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, kind: str) -> None:
        """SIGKILL: no cleanup of any kind."""
        if kind.startswith("nats-"):
            self.nats.kill(int(kind.removeprefix("nats-")))
        elif kind == "nats":
            self.nats.kill()
        else:
            os.kill(self.procs[kind].pid, signal.SIGKILL)
            self.procs[kind].wait()

    def restart(self, kind: str) -> None:
        self.restarts[kind] += 1
        self.start(kind)

    async def back(self, kind: str) -> None:
        """Until a restarted cluster member serves JetStream again and has caught up (a loop or
        the one server: at once)."""
        if kind.startswith("nats-"):
            await asyncio.to_thread(self.nats.wait_healthy, int(kind.removeprefix("nats-")))

    def engine_loads(self) -> dict[str, list[str]]:
        """The weight versions each shared engine loaded, in order (from its log)."""
        return {kind: re.findall(r"weights '([^']*)' loaded", (self.run_dir / f"{kind}.log").read_text())
                for kind in self.engine_ports}

    def alive(self) -> dict[str, bool]:
        return {kind: proc.poll() is None for kind, proc in self.procs.items()}

    async def wait_serving(self, timeout_s: float = 180.0, urls: list[str] | None = None) -> None:
        """Until every gateway (or every one of `urls`) answers `/health`."""
        deadline = time.monotonic() + timeout_s
        urls = self.serve_urls if urls is None else urls
        async with httpx.AsyncClient() as http:
            while True:
                try:
                    if all([(await http.get(f"{url}/health")).status_code == 200 for url in urls]):
                        return
                except httpx.HTTPError:
                    pass
                dead = [k for k, up in self.alive().items() if not up]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not come up (dead: {dead}); see {self.run_dir}/*.log")
                await asyncio.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.nats.stop()
