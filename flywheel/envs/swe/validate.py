"""Proving a task set valid: every task's tests behave as its record says, in its sandbox.

A task is valid when, at `base_commit`, every FAIL_TO_PASS test fails and every PASS_TO_PASS
test passes (the empty diff grades 0 for the right reason), and with `patch` applied every test
of both lists passes (the gold patch grades 1). Tasks are checked in parallel, each job in its
own sandbox slot.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from flywheel.envs.sandbox.base import SandboxBackend
from flywheel.envs.swe.grading import grade
from flywheel.envs.swe.tasks import SweTask


@dataclass
class Verdict:
    task: SweTask
    problems: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        t = self.task
        if self.ok:
            return (f"ok    {t.instance_id}  [{t.difficulty or '-'}]  F2P {len(t.FAIL_TO_PASS)}  "
                    f"P2P {len(t.PASS_TO_PASS)}  ({self.seconds:.1f} s)")
        return f"FAIL  {t.instance_id}: {'; '.join(self.problems)}"


def check(task: SweTask, backend: SandboxBackend, slot: int) -> Verdict:
    started = time.monotonic()
    problems = []
    try:
        if not task.FAIL_TO_PASS:
            problems.append("no FAIL_TO_PASS tests")
        base = grade(task, "", backend, slot).details
        passing = [t for t, ok in base.get("FAIL_TO_PASS", {}).items() if ok]
        if passing:
            problems.append(f"{len(passing)} FAIL_TO_PASS tests pass at base_commit (e.g. {passing[0]})")
        if base.get("PASS_TO_PASS_failed_count"):
            problems.append(f"{base['PASS_TO_PASS_failed_count']} PASS_TO_PASS tests fail at base_commit "
                            f"(e.g. {base['PASS_TO_PASS_failed'][0]})")
        if base.get("stats", {}).get("timed_out"):
            problems.append("the tests time out at base_commit")
        gold = grade(task, task.patch, backend, slot)
        if gold.reward != 1.0:
            problems.append(f"the gold patch does not resolve it: {gold.details['reason'][:500]}")
    except Exception as e:  # a missing repository or commit: this task is invalid, the others go on
        problems.append(f"{type(e).__name__}: {e}")
    return Verdict(task, problems, time.monotonic() - started)


def validate(tasks: list[SweTask], backend: SandboxBackend, jobs: int = 2, slot_base: int = 0,
             log: Callable[[str], None] = print) -> list[Verdict]:
    """Check every task (`jobs` at a time), logging one line per task and a summary."""
    started = time.monotonic()
    free = list(range(slot_base, slot_base + jobs))

    def one(task: SweTask) -> Verdict:
        slot = free.pop()
        try:
            verdict = check(task, backend, slot)
        finally:
            free.append(slot)
        log(verdict.line())
        return verdict

    with ThreadPoolExecutor(jobs) as pool:
        verdicts = list(pool.map(one, tasks))
    good = [v for v in verdicts if v.ok]
    tiers = Counter(v.task.difficulty or "-" for v in good)
    log(f"valid {len(good)}/{len(verdicts)} tasks ({', '.join(f'{k} {n}' for k, n in sorted(tiers.items()))}) "
        f"in {time.monotonic() - started:.1f} s")
    return verdicts
