"""Fault drills under load: kill -9 each component (collect, judge, train, serve, the NATS
server) while agents run multi-turn sessions through the gateway, restart it, and count what
was lost, truncated or duplicated, what was trained twice, and the 5xx the agents saw
(bench/drill.py). Every count but `complete` and `trained` must be 0.

    .venv/bin/python -m bench.fault_drill                      # each component alone, then all in a row
    .venv/bin/python -m bench.fault_drill --victims collect --every-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from bench.drill import drill

RESULTS = Path(__file__).resolve().parent / "results" / "fault_drill.json"
FAILURES = ("lost", "truncated", "duplicated_sessions", "duplicated_trajectories", "duplicated_samples", "trained_twice",
            "server_errors", "sessions_failed")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fault_drill", description=__doc__.splitlines()[0])
    parser.add_argument("--victims", nargs="*", default=None, help="components to kill (default: each alone, then all)")
    parser.add_argument("--every-s", type=float, default=3.0, help="seconds of load before each kill, and after the last")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    plans = [args.victims] if args.victims else [["collect"], ["judge"], ["train"], ["serve"], ["nats"],
                                                 ["collect", "judge", "train", "serve", "nats"]]
    results = []
    for victims in plans:
        with tempfile.TemporaryDirectory(prefix="flywheel-drill-") as tmp:
            report = asyncio.run(drill(Path(tmp), victims, concurrency=args.concurrency, every_s=args.every_s))
        results.append(report)
        bad = {k: report[k] for k in FAILURES if report[k]}
        print(f"kill -9 {' then '.join(victims)}: {report['complete']}/{report['sessions_answered']} sessions complete, "
              f"{report['trained']} trained, versions increasing: {report['versions_increasing']}; "
              f"{'FAILED ' + json.dumps(bad) if bad else 'nothing lost, duplicated or refused'}", flush=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(not any(r[k] for k in FAILURES) and r["versions_increasing"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
