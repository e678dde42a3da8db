"""Gold demonstrations: episodes of the built-in agent that fix a task the way an expert would,
for a supervised warm start (`flywheel sft`) before RL on the SWE environment.

A demonstration is a real episode in the task's sandbox, driven by scripted replies in the
agent's format (a THOUGHT and one bash block each):

    1. read the function the statement names:   grep -n -A N "def FUNCTION" FILE
    2. fix the buggy line from the gold patch:   sed -i 'LINEs/OLD/NEW/' FILE
    3. submit:                                   echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT

The observations are what the environment returned, and the episode is graded like any other:
only demonstrations that resolve their task are kept. OLD/NEW are the smallest differing span
of the patched line, widened to whole words; a task whose fix is not one line, whose function is
not named in its statement, or whose span cannot be written into a single-quoted sed command
has no demonstration. Small models (SmolLM2-135M) do not keep to the agent's format from the
prompt alone; a few hundred of these teach it, and some of the fixing.
"""

from __future__ import annotations

import random
import re
from typing import Any

from flywheel.envs.base import Task
from flywheel.envs.swe.agent import SUBMIT_MARKER
from flywheel.envs.swe.env import SweEnv
from flywheel.envs.swe.tasks import SweTask

_NAMED = re.compile(r"The bug is in `(\w+)` in `([^`]+)`\.")
WINDOW = 15
"""Lines shown after the function's `def`, or up to 4 past the buggy line when that is further."""


def _span(old: str, new: str) -> tuple[str, str]:
    """The differing part of two lines, widened to whole words and operators."""
    start = 0
    while start < min(len(old), len(new)) and old[start] == new[start]:
        start += 1
    end = 0
    while end < min(len(old), len(new)) - start and old[-1 - end] == new[-1 - end]:
        end += 1

    def word(c: str) -> bool:
        return c.isalnum() or c in "_<>=!"

    while start > 0 and word(old[start - 1]):
        start -= 1
    while end > 0 and word(old[len(old) - end]):
        end -= 1
    return old[start:len(old) - end], new[start:len(new) - end]


def _fix_command(task: SweTask) -> str | None:
    removed = [line[1:] for line in task.patch.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in task.patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    if len(removed) != 1 or len(added) != 1:
        return None
    old, new = _span(removed[0], added[0])
    if not old.strip() or "'" in old + new:
        return None
    pattern = re.sub(r"([\\/.\[\]*^$])", r"\\\1", old)
    replacement = re.sub(r"([\\/&])", r"\\\1", new)
    return f"sed -i '{task.extra['line']}s/{pattern}/{replacement}/' {task.extra['file']}"


def replies(task: SweTask, source: str) -> list[str] | None:
    """The expert's replies for `task` (`source`: the buggy file), None if it has no demonstration."""
    named = _NAMED.search(task.problem_statement)
    fix = _fix_command(task)
    if named is None or fix is None or "line" not in task.extra:
        return None
    function, path = named.groups()
    line = task.extra["line"]
    defs = [i + 1 for i, text in enumerate(source.splitlines()[:line]) if re.match(rf"\s*(async\s+)?def {function}\b", text)]
    if not defs:
        return None
    window = max(WINDOW, line - defs[-1] + 4)
    return [
        f'THOUGHT: the bug is in `{function}` in `{path}`; read that function.\n```bash\ngrep -n -A {window} "def {function}" {path}\n```',
        f"THOUGHT: line {task.extra['line']} is wrong; fix it.\n```bash\n{fix}\n```",
        f"THOUGHT: the fix is in place; submit.\n```bash\necho {SUBMIT_MARKER}\n```",
    ]


def demonstration(env: SweEnv, task: SweTask, slot: int = 0) -> list[dict[str, Any]] | None:
    """The demonstration of `task` as chat messages (system, statement, then replies and
    observations), None if it has none or it does not resolve the task."""
    start = env.task(task)
    messages = list(start.messages)
    episode = env.open(Task(start.id, start.messages, info=start.info), slot)
    try:
        scripted = replies(task, (episode.workdir / task.extra.get("file", "")).read_text()) if "file" in task.extra else None
        if scripted is None:
            return None
        for reply in scripted:
            step = episode.step(reply)
            messages += [{"role": "assistant", "content": reply}, *step.messages]
            if step.done:
                break
        grade = episode.finish()
    finally:
        episode.close()
    return messages if grade.reward == 1.0 else None


def split(tasks: list[SweTask], held_out: float, seed: int) -> tuple[list[SweTask], list[SweTask]]:
    """(train, held out): a seeded shuffle, `held_out` of the tasks set aside for evaluation."""
    order = sorted(tasks, key=lambda t: t.instance_id)
    random.Random(seed).shuffle(order)
    cut = round(len(order) * held_out)
    return order[cut:], order[:cut]
