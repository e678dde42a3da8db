"""Tenants under load and kill -9 (issue 43): four tenants with mixed consent, storage and
personal-data policies (`open-co` opt_out/pii off, `careful` opt_in/pii drop, `redacting`
opt_out/pii redact_input with a second key narrowed to training off, `silent` store false) hold
3-turn sessions through the gateway, some messages carrying an e-mail address, a card number or a
phone number with a marker unique to the session; the gateway and then the collector are killed
with SIGKILL mid-way and restarted. The audit scans every stream, the run directory's files
(nats-server's storage, spill files, logs, ledger, checkpoints, weights) and the decoded token ids
for anything of `silent`, of a message `careful` keeps out, or a raw value `redacting` replaces,
checks that no sample without consent was trained, and that every session of the others that may
be kept is one complete trajectory and sample, trained once if it has consent
(`flywheel/drills/tenant_drill.py`). Every failure count must be 0.

    .venv/bin/python -m bench.tenant_drill                           # 384 sessions (8 cycles of every kind)
    .venv/bin/python -m bench.tenant_drill --sessions 96 --name tenant_drill_small
    .venv/bin/python -m bench.tenant_drill --victims serve nats collect   # the bus too
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python bench/NAME.py` as well as `-m bench.NAME`

from bench.lib.common import CpuWatch, machine, quiet_logs, table, write_result  # noqa: E402
from flywheel.drills.tenant_drill import failures, tenant_drill  # noqa: E402
from flywheel.drills.tenant_load import CYCLE, KINDS, TENANTS  # noqa: E402

COLUMNS = [
    ("sessions answered", "answered"), ("PII sessions", "pii_sessions"), ("turns on bus", "turns_on_bus"),
    ("trajectories (expected)", "trajectories_on_bus", "expected_trajectories"), ("samples", "samples_on_bus"),
    ("trained (expected)", "trained", "expected_trained"), ("refused by trainer", "refused_by_trainer"),
    ("lost", "lost"), ("truncated", "truncated"), ("trained twice", "trained_twice"),
    ("trained w/o consent", "trained_without_consent"), ("leaks", "leaks"),
]


def tenant_table(report: dict) -> str:
    rows = []
    for tenant, row in report["tenants"].items():
        policy = TENANTS[tenant]
        cells = [tenant, f"{policy['training']}, pii {policy['pii']}" + (", store false" if policy.get("store") is False else "")]
        for column in COLUMNS:
            value = row.get(column[1], 0)
            cells.append(f"{value} ({row.get(column[2], 0)})" if len(column) == 3 else value)
        rows.append(cells)
    return table(["tenant", "policy", *(c[0] for c in COLUMNS)], rows)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tenant_drill", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8 * CYCLE, help=f"at least this many (whole cycles of {CYCLE})")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--victims", nargs="*", default=["serve", "collect"],
                        help="killed in turn, each after its share of the sessions (serve, collect, judge, train, nats)")
    parser.add_argument("--name", default="tenant_drill", help="the result file's name (bench/results/NAME.json)")
    args = parser.parse_args()
    quiet_logs()
    watch = CpuWatch().start()
    with tempfile.TemporaryDirectory(prefix="flywheel-tenant-drill-") as tmp:
        report = asyncio.run(tenant_drill(Path(tmp), min_sessions=args.sessions, concurrency=args.concurrency,
                                          victims=tuple(args.victims)))
    bad = failures(report)
    print(tenant_table(report))
    print(f"\nkills: {json.dumps(report['kills'])}; {report['sessions_answered']}/{report['sessions']} sessions answered, "
          f"{report['server_errors']} 5xx of {report['requests']} requests answered "
          f"({report['requests_unanswered']} more cut or refused by a kill, and retried), load {report['load_s']} s, settled {report['settled_s']} s")
    print(f"control (open-co's values seen / sent): {json.dumps(report['control'])}")
    print("FAILED " + json.dumps(bad) if bad else "nothing leaked, lost, duplicated or trained without consent")
    if report["leak_examples"]:
        print("leaks:", json.dumps(report["leak_examples"], indent=1))
    path = write_result(args.name, {
        "settings": {"sessions": args.sessions, "concurrency": args.concurrency, "victims": args.victims,
                     "tenants": TENANTS, "kinds": [asdict(k) for k in KINDS]},
        "machine": machine(torch_threads=1), "foreign_cpu": watch.stop(), "failures": bad, "report": report})
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
