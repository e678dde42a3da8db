"""A JetStream cluster of several nats-servers on this machine: for drills, tests and trying
`bus.replicas` without a Kubernetes cluster.

Each member is an `EmbeddedNats` with its own data directory, a fixed client port (so clients'
`bus.url` list stays valid across a member's restart), a route port on which the members find
one another, and an HTTP monitoring port whose `/healthz` says when the member is serving
JetStream again and has caught up (what a Kubernetes probe on a NATS pod asks too).

    flywheel nats-cluster --dir runs/nats-cluster [--nodes 3]

(`flywheel/cli/nats_cluster.py`) prints the `bus.url` to give the loops (`bus.url=... bus.replicas=3`) and runs until Ctrl-C.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from flywheel.bus.embedded import EmbeddedNats
from flywheel.ports import free_port


class LocalNatsCluster:
    """`nodes` nats-servers clustered with JetStream, each killable and restartable in place."""

    def __init__(self, data_dir: str | Path, nodes: int = 3, host: str = "127.0.0.1", name: str = "flywheel"):
        if nodes < 3:
            raise ValueError("a JetStream cluster needs at least 3 servers to keep a quorum when one is lost")
        self.host = host
        routes = [f"nats://{host}:{free_port(host)}" for _ in range(nodes)]
        self.monitor_ports = [free_port(host) for _ in range(nodes)]
        self.members = [
            EmbeddedNats(
                Path(data_dir) / f"n{i}", host, port=free_port(host),
                extra_args=["--server_name", f"n{i}", "--cluster_name", name, "--cluster", routes[i],
                            "--routes", ",".join(r for j, r in enumerate(routes) if j != i),
                            "-m", str(self.monitor_ports[i])],
            )
            for i in range(nodes)
        ]

    @property
    def url(self) -> str:
        """Every member's client URL, comma-separated: the value for `bus.url`."""
        return ",".join(f"nats://{m.host}:{m.port}" for m in self.members)

    def start(self, timeout_s: float = 60.0) -> str:
        for member in self.members:
            member.start()
        for i in range(len(self.members)):
            self.wait_healthy(i, timeout_s)
        return self.url

    def healthy(self, i: int) -> bool:
        """Member `i` serves JetStream and is current with the cluster (nats-server's /healthz)."""
        try:
            return httpx.get(f"http://{self.host}:{self.monitor_ports[i]}/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, i: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy(i):
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats-server n{i} not healthy within {timeout_s:g}s; see {self.members[i].data_dir}")
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """SIGKILL member `i`: no clean shutdown, no leadership handed over."""
        self.members[i].kill()

    def restart(self, i: int) -> None:
        """Start member `i` again on its ports and data (it rejoins and catches up)."""
        self.members[i].start()

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def __enter__(self) -> "LocalNatsCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
