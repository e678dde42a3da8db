"""One trainer per run directory: `run_dir/train.lock`, held while a train loop runs.

Whatever rewrites the trainer's state from outside (`flywheel forget --retrain` replacing its
checkpoints) takes the same lock first, and refuses while a trainer holds it: the trainer's
weights in memory would outlive the rewrite. POSIX record locks (`fcntl.lockf`) go with the
process, so a trainer killed with -9 leaves the lock free; two holders in one process do not
exclude each other (tests run loops in-process).
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import TextIO


class TrainerRunning(RuntimeError):
    """Another process holds the run directory's trainer lock."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "train.lock"
        self._file: TextIO | None = None

    def acquire(self) -> None:
        """Hold the lock, or raise `TrainerRunning` at once."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = self.path.open("a")
        try:
            fcntl.lockf(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.close()
            raise TrainerRunning(f"a trainer holds {self.path}") from None
        self._file = file

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
