"""Where sandboxes' working directories live on this machine.

`work_root()` is `$FLYWHEEL_SANDBOX_WORK`, else /var/tmp/flywheel/sandboxes: on disk rather
than in /tmp (which each sandbox replaces with a small private tmpfs, and which a machine may
clear), and shared by every environment that sandboxes (SWE episodes and grading, HumanEval's
verifier). `new_workdir` names a fresh one; a backend's `close()` removes it.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path


def work_root() -> Path:
    """`$FLYWHEEL_SANDBOX_WORK` if set, else /var/tmp/flywheel/sandboxes (made if missing)."""
    root = Path(os.environ.get("FLYWHEEL_SANDBOX_WORK", "/var/tmp/flywheel/sandboxes"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def new_workdir(tag: str) -> Path:
    """A unique path under `work_root()` (not yet made) for one sandbox's working directory."""
    return work_root() / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)[:80]}-{uuid.uuid4().hex[:12]}"
