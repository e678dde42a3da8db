"""`flywheel serve` and `flywheel loop NAME`: one loop as a process of its own, with the bus.

What `flywheel up` hosts as Ray actors, run alone: a gateway (`serve`: the OpenAI-compatible
endpoint over the embedded engine, or over external engines with `--engine-url`), or the
`collect`, `judge`, `train` or `promote` loop, each joining the deployment whose bus `bus.url`
names. The process connects the bus (starting an embedded one when `bus.url` is `embedded`),
starts the loop, and stops it cleanly on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from flywheel.cli.arguments import add_config, load

SERVE_FLAGS = {
    "--model": ("model", str),
    "--host": ("serve.host", str),
    "--port": ("serve.port", int),
    "--engine-url": ("serve.engine_urls", list),
}
ALONE = ("collect", "judge", "train", "promote")


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    if command == "serve":
        parser.description = ("The serve loop alone: an OpenAI-compatible gateway over the embedded engine, or over "
                              "the engines at --engine-url (SGLang, vLLM, `flywheel engine`).")
        add_config(parser, SERVE_FLAGS)
        parser.set_defaults(loop="serve")
    else:
        parser.description = "One loop alone, joining the deployment whose bus `bus.url` names."
        parser.add_argument("loop", choices=ALONE)
        add_config(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from flywheel.config.imports import import_object
    from flywheel.deploy.loop_classes import LOOPS
    from flywheel.runtime import tune_gc

    config = load(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tune_gc()
    asyncio.run(run_until_signalled(import_object(LOOPS[args.loop]), config))
    return 0


async def run_until_signalled(factory, config) -> None:
    from flywheel.bus.embedded import start_bus

    url, server = start_bus(config.bus.url, config.run_dir)
    try:
        loop = factory(config, url)
        await loop.start()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await loop.stop()
    finally:
        if server is not None:
            server.stop()
