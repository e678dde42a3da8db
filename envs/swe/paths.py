"""Where SWE task machinery keeps things on this machine.

`cache_root()` is Flywheel's cache (`$FLYWHEEL_CACHE`, else `~/.cache/flywheel`, as in
`models.cache`, which is not imported because `models` loads torch): downloaded sdists and
clones of bundled task repositories live under its `swe/`. `work_root()` holds sandbox working
directories; it is never under /tmp, which the sandbox replaces with a private one.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("FLYWHEEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flywheel"


def work_root() -> Path:
    """`$FLYWHEEL_SWE_WORK` if set, else /var/tmp/flywheel/swe (made if missing)."""
    root = Path(os.environ.get("FLYWHEEL_SWE_WORK", "/var/tmp/flywheel/swe"))
    root.mkdir(parents=True, exist_ok=True)
    return root
