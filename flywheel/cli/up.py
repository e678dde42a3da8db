"""`flywheel up [--config FILE] [key=value ...]`: the whole platform, with live progress.

Hosts the loops as Ray actors with the bus (see `Deployment`) and shows what they do until
Ctrl-C (or SIGTERM), which stops everything and leaves no process behind. With no `--config`
it runs the built-in defaults: the `tiny` model learning the `digits` task, on this machine.
"""

from __future__ import annotations

import argparse
import logging

from flywheel.cli.arguments import add_config, load


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = __doc__.split("\n\n")[1].replace("\n", " ")
    add_config(parser)
    parser.add_argument("--refresh-s", type=float, default=1.0, help="progress refresh period (seconds)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = load(args)  # refused before Ray imports

    from rich.console import Console

    from flywheel.deploy.deployment import Deployment
    from flywheel.deploy.foreground import run_in_foreground

    logging.basicConfig(level=logging.WARNING)
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
