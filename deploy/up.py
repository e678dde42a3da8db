"""`python -m deploy.up --config FILE [key=value ...]`: run the whole platform, with live progress.

Hosts the four loops as Ray actors with the bus (see `Deployment`) and shows what they do until
Ctrl-C (or SIGTERM), which stops everything and leaves no process behind.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

from rich.console import Console
from rich.live import Live

from config import ConfigError, load_config
from deploy.deployment import Deployment
from deploy.progress import progress_line, progress_table


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.up", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--refresh-s", type=float, default=1.0, help="progress refresh period")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    console = Console()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    deployment = Deployment(config)
    try:
        with console.status("starting the bus, Ray and the loops..."):
            deployment.start()
        signal.signal(signal.SIGTERM, _raise_interrupt)  # again: starting Ray installed its own handler
        console.print(
            f"Flywheel is up. OpenAI endpoint: {deployment.serve_url}/v1  model: {config.model}  "
            f"bus: {deployment.bus_url}  run dir: {config.run_dir}  (Ctrl-C stops)",
            highlight=False,
        )
        if console.is_terminal:
            with Live(progress_table(deployment.stats()), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(args.refresh_s)
                    live.update(progress_table(deployment.stats()))
        else:
            while True:
                time.sleep(args.refresh_s)
                print(progress_line(deployment.stats()), flush=True)
    except KeyboardInterrupt:
        console.print("stopping...")
    finally:
        deployment.stop()
    console.print("stopped.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
