"""What a sandbox is, independent of how it is made: the seam between SWE environments and the
isolation technology (bubblewrap here; a container or Kubernetes-pod backend at scale).

A `SandboxBackend` opens a `Sandbox` over a private, writable working directory for one parallel
slot. `Sandbox.execute` runs one shell command (a fresh `bash -c`, stateless like mini-swe-agent's
environments: `cd` and `export` do not persist) under the spec's limits and returns
mini-swe-agent's result shape. `close()` kills everything the sandbox started and removes its
working directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypedDict

from flywheel.config import ConfigError


class SandboxUnavailable(ConfigError):
    """This machine cannot make the sandbox a backend promises (its tool is missing, or the kernel
    or container forbids the namespaces it needs). The message says what is missing and how to
    get it. Backends raise it instead of ever running a command unsandboxed."""


class ExecResult(TypedDict):
    output: str
    """stdout and stderr interleaved, cut to the last `Limits.output_bytes`."""
    returncode: int
    """The command's exit status; 124 when the wall-clock timeout killed it."""
    exception_info: str
    """Empty, or what went wrong around the command (timeout, sandbox failure)."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 60.0
    """Wall-clock limit per command (overridable per call)."""
    cpu_s: int = 300
    memory_bytes: int = 4 << 30
    """Address-space limit of each process."""
    processes: int = 256
    """Processes of the slot's uid (binds only because commands run as a non-root uid)."""
    file_size_bytes: int = 1 << 30
    open_files: int = 1024
    output_bytes: int = 20_000
    tmp_bytes: int = 512 << 20
    """Size of the private /tmp (memory-backed, so it counts against host memory)."""


@dataclass(frozen=True)
class SandboxSpec:
    workdir: Path
    """The private writable copy (a task's repository); commands start in it."""
    readonly: tuple[Path, ...] = ()
    """Extra host paths exposed read-only (e.g. the test environment's virtualenv)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of every command (PATH, PYTHONPATH, ...)."""
    limits: Limits = Limits()


class Sandbox(Protocol):
    spec: SandboxSpec

    def execute(self, command: str, cwd: str = "", timeout: float | None = None) -> ExecResult: ...

    def close(self) -> None: ...


class SandboxBackend(Protocol):
    name: str

    def open(self, spec: SandboxSpec, slot: int) -> Sandbox: ...
