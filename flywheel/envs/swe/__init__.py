"""SWE tasks: bugs injected into real open-source projects, fixed by an agent in a sandbox.

    tasks = load_tasks(TINY_TASKS)                 # SWE-bench-format JSONL (+ repos/ beside it)
    materialize(tasks[0], dest)                    # its buggy tree as a one-commit repository
    grade(tasks[0], diff, backend, slot)           # envs.base.Grade: 1.0 iff all its tests pass

`flywheel swe build|validate|exec` makes, proves and explores task sets (`flywheel/cli/swe.py`).
This module stays light: it imports neither libcst nor the sandbox backends.
"""

from flywheel.envs.swe.grading import grade
from flywheel.envs.swe.tasks import TINY_TASKS, SweTask, load_tasks, materialize

__all__ = ["TINY_TASKS", "SweTask", "grade", "load_tasks", "materialize"]
