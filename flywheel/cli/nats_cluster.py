"""`flywheel nats-cluster --dir DIR [--nodes 3]`: a JetStream cluster of several nats-servers on
this machine (`flywheel/bus/cluster.py`), for drills and for trying `bus.replicas` without a
Kubernetes cluster. Prints the `bus.url=... bus.replicas=3` to give the loops; runs until Ctrl-C
or SIGTERM."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = " ".join(__doc__.split(": ", 1)[1].split())
    parser.add_argument("--dir", required=True, help="where the members keep their data and logs")
    parser.add_argument("--nodes", type=int, default=3)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from flywheel.bus.cluster import LocalNatsCluster

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalNatsCluster(args.dir, args.nodes) as cluster:
        print(f"bus.url={cluster.url} bus.replicas={min(args.nodes, 3)}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0
