"""Grading a candidate fix of a SWE task: the reward an RL episode ends with.

`grade(task, diff)` exports the task's buggy tree into its slot's sandbox working directory
(`workdirs.slot_workdir`, emptied first: what a grading killed mid-run left goes with the
slot's next grading instead of piling up), applies the candidate diff without its changes to
test files and pytest configuration (`testpaths.is_test_path`: a fix cannot make a test pass by
editing it), then the task's `test_patch` if it has one (SWE-bench), runs the task's test command
in the sandbox with the report plugin, and returns an `flywheel.envs.base.Grade`:

    reward   1.0 iff every FAIL_TO_PASS and every PASS_TO_PASS test passed, else 0.0
    details  resolved (bool), applied (bool), reason (why not resolved; "" when resolved),
             FAIL_TO_PASS {test id: passed}, PASS_TO_PASS_failed [ids, at most 50],
             PASS_TO_PASS_failed_count, excluded_files [test files the diff touched],
             stats {tests, passed, failed, ..., returncode, timed_out, duration_s}

A test missing from the run counts as failed. A diff that does not apply gives reward 0 with
git's reason. The same call proves a task valid (`validate`): gold patch resolves it, the empty
diff does not.
"""

from __future__ import annotations

import shutil

from flywheel.envs.base import Grade
from flywheel.envs.sandbox.base import SandboxBackend
from flywheel.envs.sandbox.workdirs import slot_workdir
from flywheel.envs.swe import gitstore
from flywheel.envs.swe.tasks import SweTask, materialize
from flywheel.envs.swe.testenv import default_backend, opened, run_tests
from flywheel.envs.swe.testpaths import split_diff, without_test_changes

LISTED_FAILURES = 50


def grade(task: SweTask, diff: str, backend: SandboxBackend | None = None, slot: int = 0) -> Grade:
    """Reward 1.0 iff `diff` (test files excluded) makes all of the task's tests pass."""
    fix, excluded = without_test_changes(diff)
    details: dict = {"resolved": False, "applied": False, "reason": "", "excluded_files": excluded}
    if diff.strip() and not split_diff(diff):
        return Grade(0.0, {**details, "reason": "the diff does not apply: it is not a unified diff"})
    workdir = slot_workdir("grade", slot)
    shutil.rmtree(workdir, ignore_errors=True)
    try:
        materialize(task, workdir)
        details["reason"] = gitstore.apply(workdir, fix)
        if not details["reason"] and (problem := gitstore.apply(workdir, task.test_patch)):
            raise ValueError(f"{task.instance_id}: its test_patch does not apply: {problem}")
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    if details["reason"]:
        details["reason"] = f"the diff does not apply: {details['reason']}"
        shutil.rmtree(workdir, ignore_errors=True)
        return Grade(0.0, details)
    details["applied"] = True
    with opened(backend or default_backend(), workdir, task.pythonpath, task.timeout_s, slot) as sandbox:
        run = run_tests(sandbox, task.test_cmd, task.timeout_s)
    f2p = {t: run.passed(t) for t in task.FAIL_TO_PASS}
    p2p_failed = [t for t in task.PASS_TO_PASS if not run.passed(t)]
    resolved = bool(f2p) and all(f2p.values()) and not p2p_failed
    if run.timed_out:
        reason = f"the tests timed out after {task.timeout_s:g} s"
    elif not run.tests:
        reason = f"no test ran (rc {run.returncode}): {run.output[-1000:]}"
    elif not resolved:
        reason = (f"{sum(not ok for ok in f2p.values())} of {len(f2p)} FAIL_TO_PASS tests and "
                  f"{len(p2p_failed)} of {len(task.PASS_TO_PASS)} PASS_TO_PASS tests fail")
    else:
        reason = ""
    details.update(resolved=resolved, reason=reason, FAIL_TO_PASS=f2p,
                   PASS_TO_PASS_failed=p2p_failed[:LISTED_FAILURES], PASS_TO_PASS_failed_count=len(p2p_failed),
                   stats=run.stats())
    return Grade(1.0 if resolved else 0.0, details)
