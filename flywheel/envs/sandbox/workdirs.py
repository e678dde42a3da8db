"""Where sandboxes' working directories live on this machine.

`work_root()` is `$FLYWHEEL_SANDBOX_WORK`, else /var/tmp/flywheel/sandboxes: on disk rather
than in /tmp (which each sandbox replaces with a small private tmpfs, and which a machine may
clear), and shared by every environment that sandboxes (SWE episodes and grading, HumanEval's
verifier). `new_workdir` names a fresh one; a backend's `close()` removes it. `slot_workdir`
names the one a slot's holder reuses (an SWE episode's, a grading's).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from flywheel.envs.sandbox.bubblewrap import default_uid_base


def work_root() -> Path:
    """`$FLYWHEEL_SANDBOX_WORK` if set, else /var/tmp/flywheel/sandboxes (made if missing)."""
    root = Path(os.environ.get("FLYWHEEL_SANDBOX_WORK", "/var/tmp/flywheel/sandboxes"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def new_workdir(tag: str) -> Path:
    """A unique path under `work_root()` (not yet made) for one sandbox's working directory."""
    return work_root() / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)[:80]}-{uuid.uuid4().hex[:12]}"


def slot_workdir(kind: str, slot: int) -> Path:
    """The working directory (not made, nor emptied) of `kind` ("episode", "grade") at `slot`: one
    per slot, whose one holder at a time empties it first, so what a killed holder left (a run's
    env workers are killed when it ends, some mid-grading) goes with the slot's next one instead
    of piling up. Named by the slot's uid (`default_uid_base()` + slot): processes that number
    their slots alike (two test workers, two rollout processes) have bases of their own, which keep
    their directories apart as they keep their sandboxes'."""
    return work_root() / f"{kind}-uid-{default_uid_base() + slot}"
