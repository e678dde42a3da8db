"""`flywheel SUBCOMMAND ...`: the entry point of the command (`[project.scripts]`).

Only the module of the subcommand being run is imported (`configure` adds its arguments), so
`flywheel --help` and each subcommand start without loading what the others need. `kill -USR1`
a running command to have it print every thread's stack to stderr (one that does not stop or
answer says where it waits).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import signal
import sys

from flywheel.cli.arguments import ConfigArgumentError, fail, split_overrides

# name: (module under flywheel.cli, what `flywheel --help` says of it), in the order it lists them
COMMANDS = {
    "up": ("up", "run the whole platform on this machine, with live progress"),
    "serve": ("loops", "the OpenAI-compatible gateway as a process of its own"),
    "loop": ("loops", "the collect, judge, train or promote loop as a process of its own"),
    "engine": ("engine", "the embedded engine alone, speaking SGLang's protocol"),
    "train": ("train", "offline RL on an environment's tasks, through the same loops"),
    "sft": ("sft", "supervised fine-tuning on chat transcripts (a warm start before RL)"),
    "versions": ("versions", "the policy versions of a running deployment, and an operator's say"),
    "tail": ("tail", "print the records of a stream as JSON lines"),
    "forget": ("forget", "remove a tenant's or an end user's records, and say which versions learned from them"),
    "memory": ("memory", "what the served memory gives a tenant's end user, or clearing it"),
    "swe": ("swe", "SWE task sets: build, validate, run a command in a task's sandbox, demonstrations"),
    "config": ("config", "the resolved configuration, or the reference of every key"),
    "nats-cluster": ("nats_cluster", "a JetStream cluster of several servers on this machine"),
}


def parser(command: str | None) -> argparse.ArgumentParser:
    """The parser, with the arguments of `command` (the others listed by name only)."""
    top = argparse.ArgumentParser(
        prog="flywheel",
        description="Continuous RL from an LLM agent's traffic: serve, collect, judge, train.",
        epilog="`flywheel SUBCOMMAND --help` tells more. The whole platform on this machine: `flywheel up`.",
    )
    subcommands = top.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, (module, summary) in COMMANDS.items():
        sub = subcommands.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")
        if name == command:
            importlib.import_module(f"flywheel.cli.{module}").configure(sub, name)
    return top


def main(argv: list[str] | None = None) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where every thread waits
    words, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    command = next((word for word in words if not word.startswith("-")), None)
    top = parser(command)
    args = top.parse_args(words)
    if overrides and not hasattr(args, "shortcuts"):
        top.error(f"{args.command} takes no key=value settings (got {' '.join(overrides)})")
    args.overrides = overrides
    try:
        return args.run(args)
    except ConfigArgumentError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return 130
