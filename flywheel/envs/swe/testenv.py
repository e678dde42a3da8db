"""A SWE task's test environment and how its test suite runs in a sandbox.

Commands of a task run in a sandbox (`flywheel.envs.sandbox`) whose working directory is a private copy
of the repository. The environment is the project's own venv (`sys.prefix`, exposed read-only,
first on PATH) with the library imported from the repository through PYTHONPATH; nothing is
installed. Plugins of that venv do not load automatically (`PYTEST_DISABLE_PLUGIN_AUTOLOAD`).

`run_tests` runs a task's test command with the report plugin (`pytest_plugin/swe_report.py`,
its folder exposed read-only and first on PYTHONPATH, and PYTHONSAFEPATH keeping the working
directory off the front of sys.path, so that no file of the repository can stand in for it;
loaded through `PYTEST_ADDOPTS`) and
reads the per-test outcomes back from the file the plugin writes into the working directory.
Grading is by test id, so ids must not change from run to run: PYTHONHASHSEED is fixed, and
the suite runs without address-space randomization (`setarch -R`), since `hash(None)` and other
identity hashes follow addresses (isodate's parameters come from a set of tuples holding None).
Sandbox working directories live under `flywheel.envs.sandbox.workdirs.work_root()`.
"""

from __future__ import annotations

import functools
import json
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.envs.sandbox.base import Limits, Sandbox, SandboxBackend, SandboxSpec

PLUGIN_DIR = Path(__file__).resolve().parent / "pytest_plugin"
REPORT_FILE = ".swe_report.json"


@functools.cache
def default_backend() -> SandboxBackend:
    """The bubblewrap backend (made once per process)."""
    from flywheel.envs.sandbox import make_backend

    return make_backend("bubblewrap")


def venv_dir() -> Path:
    return Path(sys.prefix)


def task_env(workdir: Path, pythonpath: str) -> dict[str, str]:
    """What every command of a task sees: the venv first on PATH, the library on PYTHONPATH."""
    return {
        "PATH": f"{venv_dir() / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": str((workdir / pythonpath).resolve()),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONHASHSEED": "0",  # test ids built from sets (isodate) stay the same from run to run
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
    }


def sandbox_spec(workdir: Path, pythonpath: str, timeout_s: float) -> SandboxSpec:
    return SandboxSpec(workdir=workdir, readonly=(venv_dir(), PLUGIN_DIR), env=task_env(workdir, pythonpath),
                       limits=Limits(timeout_s=timeout_s))


@contextmanager
def opened(backend: SandboxBackend, workdir: Path, pythonpath: str, timeout_s: float, slot: int) -> Iterator[Sandbox]:
    """A sandbox over `workdir` (removed with it at the end, also when opening fails)."""
    try:
        sandbox = backend.open(sandbox_spec(workdir, pythonpath, timeout_s), slot)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    try:
        yield sandbox
    finally:
        sandbox.close()


@dataclass
class TestRun:
    """One run of a test suite: per-test outcomes (empty when nothing was collected)."""

    tests: dict[str, dict[str, str]] = field(default_factory=dict)
    """nodeid -> {"outcome": passed|failed|error|skipped|xfailed|xpassed, "message": ...}"""
    returncode: int = 0
    timed_out: bool = False
    duration_s: float = 0.0
    output: str = ""
    """The tail of the command's output."""

    def passed(self, nodeid: str) -> bool:
        return self.tests.get(nodeid, {}).get("outcome") == "passed"

    def stats(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.tests.values():
            counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        return {"tests": len(self.tests), **counts, "returncode": self.returncode,
                "timed_out": self.timed_out, "duration_s": round(self.duration_s, 3)}


def run_tests(sandbox: Sandbox, test_cmd: str, timeout_s: float) -> TestRun:
    """Run `test_cmd` in `sandbox` (at its working directory) with the report plugin."""
    report = Path(sandbox.spec.workdir) / REPORT_FILE
    report.unlink(missing_ok=True)
    command = (f'export SWE_REPORT="$PWD/{REPORT_FILE}" PYTEST_ADDOPTS="-p swe_report" PYTHONSAFEPATH=1 '
               f'PYTHONPATH={shlex.quote(str(PLUGIN_DIR))}:"$PYTHONPATH"; '
               f'exec setarch -R bash -c {shlex.quote(test_cmd)}')
    started = time.monotonic()
    result = sandbox.execute(command, timeout=timeout_s)
    run = TestRun(returncode=result["returncode"], timed_out=result["returncode"] == 124,
                  duration_s=time.monotonic() - started, output=result["output"])
    if not run.timed_out and report.exists():
        try:
            run.tests = json.loads(report.read_text())["tests"]
        except (ValueError, KeyError):
            run.tests = {}
    return run
