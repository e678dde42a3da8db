"""`arithmetic`: addition, subtraction and multiplication, as bare expressions and (optionally)
as short word problems; reward 1 when the last integer in the answer is the result, else 0.

The last integer, not the first: a model that works the problem out ("3 boxes of 4 is 12") is
judged on its conclusion. A fixed held-out set (`held_out(n)`, drawn from its own seed) never
appears in training: `reset` redraws any problem in it, so accuracy on it measures learning,
not memory. With `attempts` > 1 a wrong answer is met with "try again" (a multi-turn episode).
"""

from __future__ import annotations

import random
import re

from flywheel.envs.base import AnswerEnv, Task

_INTEGER = re.compile(r"-?\d+")
HELD_OUT_SEED = 20_261_121

_WORD_PROBLEMS = {
    "+": ("{name} has {a} {thing}s and gets {b} more. How many {thing}s does {name} have now?",
          "A shelf holds {a} {thing}s and another holds {b}. How many {thing}s are there in all?"),
    "-": ("{name} had {a} {thing}s and gave away {b}. How many {thing}s are left?",
          "There were {a} {thing}s; {b} were taken. How many {thing}s remain?"),
    "*": ("{name} buys {a} bags with {b} {thing}s in each. How many {thing}s is that?",
          "There are {a} rows of {b} {thing}s. How many {thing}s are there?"),
}
_NAMES = ("Ana", "Ben", "Chloe", "Dev", "Eli", "Fay")
_THINGS = ("apple", "book", "coin", "marble", "pencil", "stamp")


class ArithmeticEnv(AnswerEnv):
    name = "arithmetic"

    def __init__(self, max_operand: int = 20, word_problems: bool = False, held_out_size: int | None = None,
                 attempts: int = 1):
        if max_operand < 1:
            raise ValueError("max_operand must be at least 1")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.attempts = attempts
        self.max_operand = max_operand
        self.word_problems = word_problems
        if held_out_size is None:  # a fifth of the bare problems, at most 200
            held_out_size = min(200, (max_operand + 1) ** 2 * 3 // 5)
        self._held_out = self._draw(random.Random(HELD_OUT_SEED), held_out_size, exclude=set())
        self._held_out_keys = {t.info["key"] for t in self._held_out}

    def held_out(self, n: int | None = None) -> list[Task]:
        """The first `n` problems of the fixed evaluation set (never trained on)."""
        return self._held_out[:n]

    def _problem(self, rng: random.Random) -> Task:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice("+-*")
        if op == "-" and self.word_problems and b > a:
            a, b = b, a  # nobody gives away more than they have
        result = a + b if op == "+" else a - b if op == "-" else a * b
        if self.word_problems and rng.random() < 0.5:
            template = rng.choice(_WORD_PROBLEMS[op])
            question = template.format(name=rng.choice(_NAMES), thing=rng.choice(_THINGS), a=a, b=b)
            key = f"w{a}{op}{b}:{template[:12]}"
        else:
            question, key = f"What is {a} {op} {b}?", f"{a}{op}{b}"
        return Task(
            id=f"arith-{a}{op}{b}-{rng.getrandbits(32):08x}",
            messages=[{"role": "user", "content": f"{question} Answer with the number only."}],
            answer=result,
            info={"key": key},
        )

    def _draw(self, rng: random.Random, n: int, exclude: set[str]) -> list[Task]:
        tasks: list[Task] = []
        seen = set(exclude)
        for _ in range(100 * n):
            if len(tasks) == n:
                break
            task = self._problem(rng)
            if task.info["key"] not in seen:
                seen.add(task.info["key"])
                tasks.append(task)
        return tasks

    def reset(self, rng: random.Random) -> Task:
        for _ in range(1000):
            task = self._problem(rng)
            if task.info["key"] not in self._held_out_keys:
                return task
        raise RuntimeError("the held-out set covers (almost) every problem: raise max_operand")

    def verify(self, task: Task, answer: str, slot: int = 0) -> float:
        numbers = _INTEGER.findall(answer)
        return float(bool(numbers) and int(numbers[-1]) == task.answer)
