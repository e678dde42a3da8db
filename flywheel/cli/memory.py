"""`flywheel memory --tenant T [--user U] [--clear]`: what the served memory gives a person (the
instructions read from their corrections: flywheel/serve/served_memory.py; without `--user`, the
tenant's traffic that names no user), or with `--clear` their memory cleared, all of the tenant's
people's without `--user` (flywheel/tenants/memory_clear.py: on the audit log, as who asked).
Their records and adapters stay; `flywheel forget` removes those.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from flywheel.cli.arguments import add_config, bus_url, load


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = " ".join(__doc__.split(": ", 1)[1].split())
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--user", help="one end user of the tenant")
    parser.add_argument("--clear", action="store_true", help="clear it (without --user: every person of the tenant's)")
    parser.add_argument("--operator", default="cli", help="who asks (kept on the audit log)")
    add_config(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from flywheel.bus import Bus
    from flywheel.config.tenants import retention_s
    from flywheel.serve.served_memory import ServedMemory
    from flywheel.tenants.memory_clear import clear_memory

    config = load(args)

    async def main() -> dict:
        bus = await Bus.connect(bus_url(config), name="memory", replicas=config.bus.replicas,
                                retention=retention_s(config.tenants))
        try:
            if args.clear:
                erased = await clear_memory(bus, args.tenant, args.user, args.operator)
                return {"tenant": args.tenant, "user": args.user, "cleared": True, "records_erased": erased}
            memory, _ = await ServedMemory.read(bus, config)
            served = memory.of(args.tenant, args.user)
            return {"tenant": args.tenant, "user": args.user, "instructions": list(served.instructions),
                    "aspects": list(served.aspects)}
        finally:
            await bus.close()

    print(json.dumps(asyncio.run(main()), indent=2))
    return 0
