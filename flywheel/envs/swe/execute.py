"""A sandbox over a fresh copy of a task's buggy repository, and one-shot commands in it.

`open_sandbox` materializes the task (its tree in a new one-commit repository) into a working
directory and opens a sandbox on it with the task's test environment (the venv on
PATH, the library on PYTHONPATH): what an agent works in. Closing the sandbox removes the copy.
The `swe` environment's episodes open theirs with it; `execute` is the one-command form behind
`flywheel swe exec`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flywheel.envs.sandbox.base import ExecResult, Sandbox, SandboxBackend
from flywheel.envs.sandbox.workdirs import new_workdir
from flywheel.envs.swe.tasks import SweTask, materialize
from flywheel.envs.swe.testenv import default_backend, sandbox_spec


def open_sandbox(task: SweTask, backend: SandboxBackend | None = None, slot: int = 0,
                 timeout_s: float | None = None, workdir: Path | None = None) -> Sandbox:
    """A sandbox at the task's base_commit; commands time out after `timeout_s` (default: the task's).
    It works in `workdir` (default: a new one), emptied first: an episode reuses its slot's own,
    where a crashed predecessor may have left a copy."""
    workdir = workdir or new_workdir(f"task-{task.instance_id}")
    shutil.rmtree(workdir, ignore_errors=True)
    try:
        materialize(task, workdir)
        return (backend or default_backend()).open(
            sandbox_spec(workdir, task.pythonpath, timeout_s or task.timeout_s), slot)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


def execute(task: SweTask, command: str, timeout_s: float | None = None, backend: SandboxBackend | None = None,
            slot: int = 0) -> ExecResult:
    """Run one shell command in a fresh sandbox of `task` (rc 124 on timeout)."""
    sandbox = open_sandbox(task, backend, slot, timeout_s)
    try:
        return sandbox.execute(command)
    finally:
        sandbox.close()
