"""The task a mini-swe-agent check works: the first task of the checked-in tiny SWE task set (a
small repository with one bug when the set is missing), materialized with what a sandbox over it
needs, and its grade of what the agent left. `SLOT` is the sandbox slot such checks use."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from flywheel.envs.swe.mini_swe_agent_venv import ROOT

SLOT = 40
"""The sandbox uid is the uid base (10000) + slot: far from the slots tests and rollouts use."""


def prepare_task(work: Path) -> tuple[dict[str, Any], Any]:
    """(what the client needs, the `SweTask` or None): the first task of the tiny SWE task set,
    materialized under `work`; a small repository with one bug when the task set is missing."""
    from flywheel.envs.sandbox.bubblewrap import interpreter_prefixes
    from flywheel.envs.swe.testenv import sandbox_spec

    work.mkdir(parents=True, exist_ok=True)
    workdir = work / "repo"
    task = None
    try:
        from flywheel.envs.swe import TINY_TASKS, load_tasks, materialize

        task = load_tasks(TINY_TASKS)[0]
        materialize(task, workdir)
        info = {"source": str(TINY_TASKS.relative_to(ROOT)), "instance_id": task.instance_id,
                "problem_statement": task.problem_statement, "pythonpath": task.pythonpath}
    except (ImportError, FileNotFoundError, IndexError) as e:
        task = None
        workdir.mkdir(parents=True)
        (workdir / "calc.py").write_text("def add(a, b):\n    return a - b\n")
        (workdir / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
        git = ["git", "-c", "user.name=flywheel", "-c", "user.email=flywheel@localhost"]
        subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
        subprocess.run([*git, "add", "-A"], cwd=workdir, check=True)
        subprocess.run([*git, "commit", "-qm", "base"], cwd=workdir, check=True)
        info = {"source": f"fallback repository ({type(e).__name__}: {e})", "instance_id": "fallback__calc-1",
                "problem_statement": "add(2, 3) returns -1 instead of 5.", "pythonpath": "."}
    spec = sandbox_spec(workdir, info["pythonpath"], timeout_s=60)
    # The task's `python` is this process's venv: expose its interpreter too, whatever the
    # client's venv was made from (the backend binds only the opening process's interpreter).
    readonly = [str(p) for p in (*spec.readonly, *interpreter_prefixes())]
    return {**info, "workdir": str(workdir), "env": spec.env, "readonly": list(dict.fromkeys(readonly))}, task


def episode_reward(task: Any, workdir: Path) -> tuple[float, dict[str, Any]]:
    """The task's grade of what the agent left in the repository (the tiny set's `grade`)."""
    from flywheel.envs.sandbox import make_backend
    from flywheel.envs.swe import grade
    from flywheel.envs.swe.gitstore import working_diff

    diff = working_diff(workdir)
    result = grade(task, diff, make_backend("bubblewrap"), SLOT)
    return result.reward, {"diff_chars": len(diff), "resolved": result.details.get("resolved"),
                           "reason": result.details.get("reason"), "stats": result.details.get("stats")}
