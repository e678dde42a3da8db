"""`arithmetic`: small addition, subtraction and multiplication problems; reward 1 when the
first integer in the answer is the result, else 0."""

from __future__ import annotations

import random
import re

from envs.base import Task

_INTEGER = re.compile(r"-?\d+")


class ArithmeticEnv:
    name = "arithmetic"

    def __init__(self, max_operand: int = 20):
        self.max_operand = max_operand

    def reset(self, rng: random.Random) -> Task:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        question = f"What is {a} {op} {b}? Answer with the number only."
        return Task(
            id=f"arith-{a}{op}{b}-{rng.getrandbits(32):08x}",
            messages=[{"role": "user", "content": question}],
            answer=result,
        )

    def verify(self, task: Task, answer: str) -> float:
        match = _INTEGER.search(answer)
        return float(match is not None and int(match.group()) == task.answer)
