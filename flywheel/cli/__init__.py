"""The `flywheel` command: one subcommand per thing a user starts (`flywheel --help` lists them).

Every subcommand that runs or reads a deployment takes the same `--config FILE` and `key=value`
overrides (`flywheel/cli/arguments.py`); each lives in a module of its own here, which imports
what it runs only when it runs, so `flywheel --help` answers at once.
"""

import sys
from pathlib import Path


def command(*args: str) -> list[str]:
    """The argv that runs `flywheel ARGS...` from this interpreter's environment: how programs
    that start Flywheel's parts as processes of their own (drills, benchmarks, tests) start them."""
    return [str(Path(sys.executable).parent / "flywheel"), *args]
