"""Fault drills under load: kill -9 each component (collect, judge, train, serve, the NATS
server) while agents run multi-turn sessions through the gateway, restart it, and count what
was lost, truncated or duplicated, what was trained twice, and the 5xx the agents saw
(`flywheel/drills/fault.py`). Every count but `complete` and `trained` must be 0.

    .venv/bin/python -m bench.fault_drill                      # each component alone, then all in a row
    .venv/bin/python -m bench.fault_drill --victims collect --every-s 10
    .venv/bin/python -m bench.fault_drill --nats-nodes 3 --victims nats-0 nats-1 \
        --out bench/results/fault_drill_nats_cluster.json              # a 3-server bus
    .venv/bin/python -m bench.fault_drill --gateways 2 --victims serve-1 \
        --out bench/results/fault_drill_gateways.json                  # one of two gateways
    .venv/bin/python -m bench.fault_drill --gateways 2 --route session --victims serve-1 \
        --out bench/results/fault_drill_gateways_by_session.json       # the same, routed by session
    .venv/bin/python -m bench.fault_drill --gateways 2 --engines 2 --route session --victims serve serve-1 \
        --out bench/results/fault_drill_shared_engines.json            # two gateways sharing two engines
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import RESULTS  # noqa: E402
from flywheel.drills.fault import FAILURES, drill  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fault_drill", description=__doc__.splitlines()[0])
    parser.add_argument("--victims", nargs="*", default=None, help="components to kill (default: each alone, then all)")
    parser.add_argument("--every-s", type=float, default=3.0, help="seconds of load before each kill, and after the last")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--nats-nodes", type=int, default=1,
                        help="with --victims: 3 runs the bus as a JetStream cluster (victims nats-0, nats-1, nats-2)")
    parser.add_argument("--gateways", type=int, default=1,
                        help="with --victims: gateways behind a balancer (victims serve, serve-1, ...)")
    parser.add_argument("--engines", type=int, default=0,
                        help="with --gateways: the gateways share this many `flywheel engine` processes "
                             "(serve swaps their weights, the others follow; victims engine-0, ...)")
    parser.add_argument("--route", choices=["round-robin", "session"], default="round-robin",
                        help="how the balancer in front of several gateways picks one (session: hash of X-Session-Id)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fault_drill.json", help="where the reports go (JSON)")
    args = parser.parse_args()
    plans = [(args.victims, args.nats_nodes, args.gateways)] if args.victims else [
        (["collect"], 1, 1), (["judge"], 1, 1), (["train"], 1, 1), (["serve"], 1, 1), (["nats"], 1, 1),
        (["collect", "judge", "train", "serve", "nats"], 1, 1), (["nats-0", "nats-1"], 3, 1), (["serve-1"], 1, 2)]
    results = []
    for victims, nats_nodes, gateways in plans:
        with tempfile.TemporaryDirectory(prefix="flywheel-drill-") as tmp:
            report = asyncio.run(drill(Path(tmp), victims, concurrency=args.concurrency, every_s=args.every_s,
                                       nats_nodes=nats_nodes, gateways=gateways, by_session=args.route == "session",
                                       engines=args.engines))
        results.append(report)
        bad = {k: report[k] for k in FAILURES if report[k]}
        print(f"kill -9 {' then '.join(victims)}: {report['complete']}/{report['sessions_answered']} sessions complete, "
              f"{report['trained']} trained, versions increasing: {report['versions_increasing']}; "
              f"{'FAILED ' + json.dumps(bad) if bad else 'nothing lost, duplicated or refused'}", flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(not any(r[k] for k in FAILURES) and r["versions_increasing"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
