"""Running one loop as a process of its own: `python -m serve|collect|judge|train`.

Each loop object has `async start()`, `async stop()` and `stats()`. `loop_main` parses
`--config FILE` and `key=value` overrides, connects the bus (starting an embedded one when
`bus.url` is `embedded`), starts the loop, and stops it cleanly on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import logging
import signal
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from bus.embedded import start_bus
from config import ConfigError, FlywheelConfig, load_config
from config.imports import import_object

log = logging.getLogger(__name__)


class Loop(Protocol):
    async def start(self) -> Any: ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


LoopFactory = Callable[[FlywheelConfig, str], Loop]


def config_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--bus-url", help="NATS URL (overrides bus.url)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def config_from_args(args: argparse.Namespace, extra: list[str] | None = None) -> FlywheelConfig:
    overrides = list(args.overrides) + list(extra or [])
    if args.bus_url:
        overrides.append(f"bus.url={args.bus_url}")
    return load_config(args.config, overrides)


async def run_until_signalled(factory: LoopFactory, config: FlywheelConfig) -> None:
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


def loop_main(
    loop_spec: str,
    prog: str,
    description: str,
    argv: list[str] | None = None,
    flags: dict[str, tuple[str, type]] | None = None,
) -> int:
    """Parse and validate the command line, then import the loop (`"module:Class"`) and run it
    until signalled.

    `flags` adds shortcuts for config keys: `{"--port": ("serve.port", int)}`; a `list` kind
    makes a repeatable flag.
    """
    parser = config_parser(prog, description)
    for flag, (key, kind) in (flags or {}).items():
        if kind is list:
            parser.add_argument(flag, action="append", dest=key, help=f"adds to {key} (repeatable)")
        else:
            parser.add_argument(flag, type=kind, dest=key, help=f"sets {key}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    shortcuts = [
        f"{key}={json.dumps(getattr(args, key))}" for key, _ in (flags or {}).values() if getattr(args, key) is not None
    ]
    try:
        config = config_from_args(args, shortcuts)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    tune_gc()
    asyncio.run(run_until_signalled(import_object(loop_spec), config))
    return 0


def tune_gc() -> None:
    """Collect the youngest generation every 50,000 allocations instead of 700. The loops
    allocate many short-lived objects (every decoded record) and create almost no reference
    cycles; at the default, collections cost the collect loop ~18 % of its time
    (bench/collect_judge.py) and freed nothing."""
    gc.set_threshold(50_000, 20, 100)


async def repeat(step: Callable[[], Any], name: str, backoff_s: float = 1.0) -> None:
    """Run `await step()` forever; an exception is logged and retried after a pause, so a
    passing fault (the bus restarting, a bad record) never ends a loop. Cancel to stop."""
    step_log = logging.getLogger(name)
    task = asyncio.current_task()
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            step_log.exception("%s step failed; retrying in %.1fs", name, backoff_s)
            await asyncio.sleep(backoff_s)
        if task is not None and task.cancelling():  # a library swallowed the cancellation (gh-86296)
            raise asyncio.CancelledError


async def cancel_and_wait(tasks: Iterable[asyncio.Task], patience_s: float = 2.0) -> None:
    """Cancel `tasks` and return once every one has ended. A library may swallow a cancellation
    (nats-py's publish catches CancelledError while it flushes; `wait_for` on 3.11, gh-86296), and
    a loop that misses its one cancellation runs on: a stop that cancelled once and gathered
    waited forever (the promotion test, under a loaded full suite). A task still running after
    `patience_s` is cancelled again, with its stack logged, until all have ended."""
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        done, pending = await asyncio.wait(pending, timeout=patience_s)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: an error on the way out is the loop's own to log
        for task in pending:
            stack = io.StringIO()
            task.print_stack(file=stack)
            log.warning("task %s went on after it was cancelled; cancelling it again:\n%s", task.get_name(), stack.getvalue())
            task.cancel()
