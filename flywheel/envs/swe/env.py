"""`swe`: fix a bug in a real repository, in a sandbox, with bash commands; rewarded by the
repository's own tests.

A task is one record of a SWE-bench-format task set (`tasks`: a `tasks.jsonl` path; default:
the small set that ships with Flywheel). An episode materializes the task's repository at its
buggy commit into a private working directory, opens a sandbox on it for the episode's slot
(uid 10000 + slot), and plays the built-in coding agent's protocol (flywheel/envs/swe/agent.py): each
reply's bash command runs in the sandbox and its output is the next observation; the agent's
submit marker ends the episode. `finish` grades the working tree's diff against the base commit
with the task's tests in a fresh sandbox (changes to test files do not count): reward 1 when
every FAIL_TO_PASS and PASS_TO_PASS test passes, with the per-test outcomes as details.

`difficulty` keeps only tasks of the given tiers (e.g. `[easy]`); `instances` only the named
ones. A sandbox's uid is its slot's own, and closing a sandbox kills every process of that uid:
two processes sandboxing on one machine at once (a run and a benchmark, say) must use disjoint
slots, which `slot_base` (added to every slot) gives them. Tasks are drawn uniformly; each draw gets its own task id (`<instance_id>-<hex>`) so the
group of attempts at one draw is normalised together.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from flywheel.envs.base import Grade, Step, Task
from flywheel.envs.sandbox import make_backend
from flywheel.envs.sandbox.workdirs import slot_workdir
from flywheel.envs.swe.agent import (
    INSTANCE,
    SYSTEM,
    observation,
    parse_action,
    submission,
)
from flywheel.envs.swe.execute import open_sandbox
from flywheel.envs.swe.gitstore import working_diff
from flywheel.envs.swe.grading import grade
from flywheel.envs.swe.tasks import TINY_TASKS, SweTask, load_tasks


class SweEpisode:
    def __init__(self, task: SweTask, backend, slot: int, command_timeout_s: float):
        self.task, self.backend, self.slot = task, backend, slot
        self.workdir = slot_workdir("episode", slot)
        self.sandbox = open_sandbox(task, backend, slot, command_timeout_s, self.workdir)
        self.commands = 0
        self.submitted = False

    def step(self, reply: str) -> Step:
        action = parse_action(reply)
        if action.command is None:
            return Step([{"role": "user", "content": action.error}])
        self.commands += 1
        result = self.sandbox.execute(action.command)
        if submission(result["output"], result["returncode"]) is not None:
            self.submitted = True
            return Step(done=True)
        content = observation(result["output"], result["returncode"], result["exception_info"])
        return Step([{"role": "user", "content": content}])

    def finish(self) -> Grade:
        diff = working_diff(self.workdir)
        result = grade(self.task, diff, self.backend, self.slot)
        details: dict[str, Any] = {"instance_id": self.task.instance_id, "submitted": self.submitted,
                                   "commands": self.commands, "diff_chars": len(diff), **result.details}
        return Grade(result.reward, details)

    def close(self) -> None:
        self.sandbox.close()


class SweEnv:
    name = "swe"

    def __init__(self, tasks: str | None = None, difficulty: list[str] | None = None, instances: list[str] | None = None,
                 sandbox: str = "bubblewrap", command_timeout_s: float = 30.0, slot_base: int = 0):
        records = load_tasks(Path(tasks) if tasks else TINY_TASKS)
        if difficulty is not None:
            records = [t for t in records if t.difficulty in difficulty]
        if instances is not None:
            records = [t for t in records if t.instance_id in instances]
        if not records:
            raise ValueError(f"no task in {tasks or TINY_TASKS} matches difficulty={difficulty} instances={instances}")
        self.tasks = {t.instance_id: t for t in records}
        self.backend = make_backend(sandbox)
        self.command_timeout_s = command_timeout_s
        self.slot_base = slot_base

    def reset(self, rng: random.Random) -> Task:
        record = self.tasks[rng.choice(sorted(self.tasks))]
        return self.task(record, suffix=f"-{rng.getrandbits(32):08x}")

    def task(self, record: SweTask, suffix: str = "") -> Task:
        statement = INSTANCE.format(problem_statement=record.problem_statement)
        return Task(
            id=record.instance_id + suffix,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": statement}],
            info={"instance_id": record.instance_id},
        )

    def open(self, task: Task, slot: int = 0) -> SweEpisode:
        return SweEpisode(self.tasks[task.info["instance_id"]], self.backend, self.slot_base + slot, self.command_timeout_s)
