"""`flywheel forget --tenant T [--user U] [--retrain]`: remove a tenant's (or one end user's) records
from the deployment's bus and run directory, and say what went and which versions learned from
them (`flywheel/tenants/forget.py`); with `--retrain`, rebuild the trainer's weights without their
samples and publish them as a new version (`flywheel/train/retrain.py`; with adapters, each
adapter they trained with others: `flywheel/train/adapter_retrain.py`; the trainer must be
stopped). Both actions are on the audit log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from flywheel.cli.arguments import add_config, bus_url, load


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = " ".join(__doc__.split(": ", 1)[1].split())
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--user", help="one end user of the tenant (default: the whole tenant)")
    parser.add_argument("--retrain", action="store_true",
                        help="rebuild the weights without their samples and publish them as a new version "
                             "(refused, before anything is removed, while the trainer runs)")
    parser.add_argument("--operator", default="cli", help="who asks (kept on the audit log)")
    add_config(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from flywheel.bus import Bus
    from flywheel.config.tenants import retention_s
    from flywheel.tenants.forget import forget
    from flywheel.tenants.forgotten import target_of
    from flywheel.train.run_lock import RunLock, TrainerRunning

    config = load(args)
    run_dir = Path(config.run_dir)
    spill_dirs = {Path(config.serve.spill_dir) if config.serve.spill_dir else run_dir / "spill"}
    lock = RunLock(run_dir)
    if args.retrain and config.adapters.kind == "lora" and config.promotion.enabled:
        print("flywheel forget: --retrain: adapters are not retrained under promotion (promotion.mode is "
              f"{config.promotion.mode}); nothing was removed", file=sys.stderr)
        return 1
    if args.retrain:
        try:
            lock.acquire()  # before anything is removed: their digests are needed to retrain
        except TrainerRunning as exc:
            print(f"flywheel forget: --retrain: {exc}; stop the trainer and run this again (nothing was removed)",
                  file=sys.stderr)
            return 1

    async def main() -> dict:
        bus = await Bus.connect(bus_url(config), name="forget", replicas=config.bus.replicas,
                                retention=retention_s(config.tenants))
        try:
            report = await forget(bus, args.tenant, args.user, spill_dirs, run_dir / "trained.jsonl", args.operator)
            result = report.as_dict()
            if args.retrain and config.adapters.kind == "lora":
                from flywheel.train.adapter_retrain import retrain_adapters

                result["retrained"] = await retrain_adapters(config, bus, report.sample_digests, args.tenant, args.user,
                                                             args.operator)
            elif args.retrain:
                from flywheel.train.retrain import retrain

                result["retrained"] = (await retrain(config, bus, report.sample_digests, target_of(args.tenant, args.user),
                                                     args.operator)).as_dict()
        finally:
            await bus.close()
        return result

    try:
        print(json.dumps(asyncio.run(main()), indent=2))
    finally:
        lock.release()
    return 0
