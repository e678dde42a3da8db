"""`flywheel train --config configs/NAME.yaml [--resume] [key=value ...]`: offline asynchronous
RL on a dataset, through the same loops as live traffic (`flywheel/deploy/offline_rl.py`).

The rollout driver sends the environment's tasks through the endpoint and reports each verdict
as feedback; the run ends at `train.max_steps` (or Ctrl-C) with `metrics.jsonl`,
`reward_curve.png` and `summary.json` in `run_dir`.
"""

from __future__ import annotations

import argparse
import logging

from flywheel.cli.arguments import ConfigArgumentError, add_config, load


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = " ".join(__doc__.split("\n\n")).replace("\n", " ").split(": ", 1)[1]
    add_config(parser)
    parser.add_argument("--resume", action="store_true", help="continue the run in run_dir from its newest checkpoint")
    parser.add_argument("--refresh-s", type=float, default=1.0, help="progress refresh period (seconds)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = load(args, ["train.resume=true"] if args.resume else [])  # refused before the loops import

    from rich.console import Console

    from flywheel.config import ConfigError
    from flywheel.deploy.offline_rl import run_offline

    logging.basicConfig(level=logging.WARNING)
    console = Console()
    try:
        summary = run_offline(config, console, args.refresh_s)
    except ConfigError as exc:
        raise ConfigArgumentError(str(exc)) from None
    console.print(f"done: {summary['steps']} steps in {summary['wall_s']:.0f} s; reward {summary['reward_first']} -> "
                  f"{summary['reward_last']}; outputs in {config.run_dir}", highlight=False)
    return 0
