"""`flywheel config [--config FILE] [key=value ...]`: the configuration a command would run with,
as YAML, every default filled in and validated; `--reference` prints the reference of every key
instead (what `docs/configuration.md` holds)."""

from __future__ import annotations

import argparse

from flywheel.cli.arguments import add_config, load


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = " ".join(__doc__.split(": ", 1)[1].split())
    parser.add_argument("--reference", action="store_true", help="print the reference of every key (Markdown)")
    add_config(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.reference:
        from flywheel.config.reference import reference

        print(reference(), end="")
        return 0
    from flywheel.config import dump_config

    print(dump_config(load(args)), end="")
    return 0
