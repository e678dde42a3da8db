"""`digits`: answer with digits only; reward = the fraction of the answer's characters that are
digits (whitespace ignored, an empty answer scores 0).

A dense reward a randomly initialised model can climb from its first step: the `tiny` model's
end-to-end test and `make run` use it to show the loop closing.
"""

from __future__ import annotations

import random

from flywheel.envs.base import AnswerEnv, Task

PROMPTS = (
    "Reply with a number.",
    "Write some digits.",
    "Give me a long number.",
    "Answer with digits only.",
)


class DigitsEnv(AnswerEnv):
    name = "digits"

    def reset(self, rng: random.Random) -> Task:
        prompt = rng.choice(PROMPTS)
        return Task(id=f"digits-{rng.getrandbits(48):012x}", messages=[{"role": "user", "content": prompt}])

    def verify(self, task: Task, answer: str, slot: int = 0) -> float:
        chars = [c for c in answer if not c.isspace()]
        if not chars:
            return 0.0
        return sum(c.isdigit() for c in chars) / len(chars)
