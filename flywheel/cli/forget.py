"""`flywheel forget --tenant T [--user U]`: remove a tenant's (or one end user's) records from the
deployment's bus and run directory, and say what went and which versions learned from them
(`flywheel/tenants/forget.py`). The action is on the audit log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from flywheel.cli.arguments import add_config, bus_url, load


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = " ".join(__doc__.split(": ", 1)[1].split())
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--user", help="one end user of the tenant (default: the whole tenant)")
    parser.add_argument("--operator", default="cli", help="who asks (kept on the audit log)")
    add_config(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from flywheel.bus import Bus
    from flywheel.tenants.forget import forget

    config = load(args)
    run_dir = Path(config.run_dir)
    spill_dirs = {Path(config.serve.spill_dir) if config.serve.spill_dir else run_dir / "spill"}

    async def main() -> dict:
        bus = await Bus.connect(bus_url(config), name="forget", replicas=config.bus.replicas)
        try:
            report = await forget(bus, args.tenant, args.user, spill_dirs, run_dir / "trained.jsonl", args.operator)
        finally:
            await bus.close()
        return report.as_dict()

    print(json.dumps(asyncio.run(main()), indent=2))
    return 0
