"""Sandboxes for agent commands (SWE environments): the backend-independent interface and the
backends behind it, picked by name with `make_backend`.

    backend = make_backend("bubblewrap")
    sandbox = backend.open(SandboxSpec(workdir=repo_copy), slot=0)
    sandbox.execute("python -m pytest -q", timeout=60)  # {"output", "returncode", "exception_info"}
    sandbox.close()                                      # kills what is left, removes repo_copy
"""

from __future__ import annotations

from typing import Any

from flywheel.config import ConfigError
from flywheel.envs.sandbox.base import (
    ExecResult,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    SandboxUnavailable,
)

BACKENDS = ("bubblewrap",)


def make_backend(name: str, **options: Any) -> SandboxBackend:
    """The sandbox backend called `name` (one of `BACKENDS`); `options` go to its constructor.
    Raises `SandboxUnavailable` when this machine cannot run it, `ConfigError` for an unknown name."""
    if name == "bubblewrap":
        from flywheel.envs.sandbox.bubblewrap import BubblewrapBackend

        return BubblewrapBackend(**options)
    raise ConfigError(f"sandbox backend: unknown name {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "ExecResult", "Limits", "Sandbox", "SandboxBackend", "SandboxSpec", "SandboxUnavailable",
           "make_backend"]
