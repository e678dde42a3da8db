"""Code named in configuration by `"package.module:Name"` (a loop, an environment), imported on
demand: a process loads only what it runs, and a config error is reported before torch loads."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(spec: str) -> Any:
    """`"package.module:Name"` -> the object."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
