"""What every `flywheel` subcommand shares: `--config FILE` and `key=value` overrides, and a
configuration error reported as one line naming the key (exit status 2).

Overrides may stand anywhere on the command line before a `--`: a word shaped `key=value` whose
key starts with a letter (`train.batch_size=16`, `run_dir=runs/x`) is an override, so
subcommands with positional arguments (`flywheel versions show 3`) take them the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flywheel.config import FlywheelConfig

OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


class ConfigArgumentError(Exception):
    """A configuration that cannot be loaded; the message names the key at fault."""


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`argv` without its overrides, the overrides), looking only before a `--`."""
    end = argv.index("--") if "--" in argv else len(argv)
    overrides = [word for word in argv[:end] if OVERRIDE.match(word)]
    rest = [word for word in argv[:end] if not OVERRIDE.match(word)] + argv[end:]
    return rest, overrides


def add_config(parser: argparse.ArgumentParser, shortcuts: dict[str, tuple[str, type]] | None = None) -> None:
    """`--config FILE`, and flags that are shortcuts for config keys: `{"--port": ("serve.port",
    int)}`; a `list` kind makes a repeatable flag that adds to the key."""
    parser.add_argument("--config", metavar="FILE", help="YAML configuration (default: the built-in defaults)")
    for flag, (key, kind) in (shortcuts or {}).items():
        if kind is list:
            parser.add_argument(flag, action="append", dest=key, help=f"adds to {key} (repeatable)")
        else:
            parser.add_argument(flag, type=kind, dest=key, help=f"sets {key}")
    parser.set_defaults(shortcuts=shortcuts or {})
    parser.epilog = ((parser.epilog or "") + "\n\nkey=value words anywhere set configuration keys "
                     "(`flywheel config --reference` lists them), after --config FILE.").lstrip("\n")


def load(args: argparse.Namespace, extra: list[str] | None = None) -> FlywheelConfig:
    """The configuration `args` asks for: the file, its overrides, then the flags' shortcuts."""
    from flywheel.config import ConfigError, load_config

    shortcuts = [f"{key}={json.dumps(getattr(args, key))}" for key, _ in args.shortcuts.values()
                 if getattr(args, key, None) is not None]
    try:
        return load_config(args.config, [*args.overrides, *shortcuts, *(extra or [])])
    except ConfigError as exc:
        raise ConfigArgumentError(str(exc)) from None


def fail(message: str) -> int:
    print(f"config error: {message}", file=sys.stderr)
    return 2


def bus_url(config: FlywheelConfig) -> str:
    """The URL of the bus a deployment of `config` uses: `bus.url`, or for an embedded bus the
    address its deployment wrote into `run_dir` (a ConfigArgumentError when none is running)."""
    from flywheel.bus.embedded import read_bus_url

    if config.bus.url != "embedded":
        return config.bus.url
    try:
        return read_bus_url(config.run_dir)
    except FileNotFoundError:
        raise ConfigArgumentError(f"run_dir: no deployment is running in {config.run_dir} (no bus.url there); "
                                  "set run_dir= or bus.url= to the one you mean") from None
