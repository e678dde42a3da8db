"""`python -m deploy.up --config FILE [key=value ...]`: run the whole platform, with live progress.

Hosts the four loops as Ray actors with the bus (see `Deployment`) and shows what they do until
Ctrl-C (or SIGTERM), which stops everything and leaves no process behind.
"""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console

from config import ConfigError, load_config
from deploy.deployment import Deployment
from deploy.foreground import run_in_foreground


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
    deployment = Deployment(config)

    def announce() -> None:
        console.print(
            f"Flywheel is up. OpenAI endpoint: {deployment.serve_url}/v1  model: {config.model}  "
            f"bus: {deployment.bus_url}  run dir: {config.run_dir}  (Ctrl-C stops)",
            highlight=False,
        )

    run_in_foreground(deployment, console, args.refresh_s, on_started=announce)
    console.print("stopped.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
