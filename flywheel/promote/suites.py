"""What a gate suite is, and the environment's suite.

A suite has items (`prompts`: token ids the evaluation server answers, the same for both
versions), gets them ready before an evaluation (`prepare`: None when ready, else why it cannot
be evaluated yet), and compares the candidate's answers with the serving version's (`compare`:
its report, and why it failed or None). Each item gets a score, higher when the candidate did
better; the suite passes when the one-sided lower confidence bound of the mean score
(`lower_bound`) is above −`margin`.

- `EnvSuite` (`source: env`): an environment's held-out tasks (`held_out(n)`; an environment
  without one: `n` tasks from a fixed seed, never the rollout's), each reply graded by the
  environment; an item's score is the candidate's reward − the serving version's.
- `flywheel.promote.traffic_suite.TrafficSuite` (`source: traffic`): recent prompts of recorded sessions,
  the two replies compared by the pinned judge.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from statistics import NormalDist, fmean, stdev
from typing import Any, Protocol

from flywheel.config.promotion import SuiteConfig
from flywheel.envs import Task, make_env

HELD_OUT_SEED = 7919
"""Where tasks are drawn for an environment without a held-out set (not the rollout's seed)."""


@dataclass
class Answer:
    text: str
    tokens: int
    cut: bool


def lower_bound(scores: list[float], confidence: float) -> float:
    """One-sided lower confidence bound of the mean of item scores (normal approximation)."""
    if len(scores) < 2:
        return -math.inf
    return fmean(scores) - NormalDist().inv_cdf(confidence) * stdev(scores) / math.sqrt(len(scores))


class Suite(Protocol):
    config: SuiteConfig
    prompts: list[list[int]]

    async def prepare(self) -> str | None: ...

    async def compare(self, candidate: list[Answer], serving: list[Answer],
                      confidence: float) -> tuple[dict[str, Any], str | None]: ...


class EnvSuite:
    def __init__(self, config: SuiteConfig, tokenizer: Any):
        assert config.env is not None, "an env suite names its environment (config.promotion checks it)"
        self.config = config
        self.env = make_env(config.env, config.env_args)
        held_out = getattr(self.env, "held_out", None)
        if held_out is not None:
            self.tasks: list[Task] = held_out(config.items)
        else:
            rng = random.Random(HELD_OUT_SEED)
            self.tasks = [self.env.reset(rng) for _ in range(config.items)]
        texts = [tokenizer.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=False) for t in self.tasks]
        self.prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]

    async def prepare(self) -> str | None:
        return None  # the held-out tasks are fixed

    async def _grades(self, answers: list[Answer]) -> list[float]:
        def grade(task: Task, reply: str) -> float:
            episode = self.env.open(task)
            try:
                episode.step(reply)
                return episode.finish().reward
            finally:
                episode.close()

        return list(await asyncio.gather(*(asyncio.to_thread(grade, t, a.text) for t, a in zip(self.tasks, answers))))

    async def compare(self, candidate: list[Answer], serving: list[Answer],
                      confidence: float) -> tuple[dict[str, Any], str | None]:
        cg, sg = await self._grades(candidate), await self._grades(serving)
        differences = [c - s for c, s in zip(cg, sg)]
        bound = lower_bound(differences, confidence)
        passed = bound > -self.config.margin
        report = {"source": "env", "items": len(differences), "candidate": fmean(cg), "serving": fmean(sg),
                  "difference": fmean(differences), "lower_bound": bound, "passed": passed}
        why = None if passed else (f"{fmean(cg):.3f} vs {fmean(sg):.3f}, lower bound of the difference {bound:+.3f} "
                                   f"at {confidence:.0%} ≤ −{self.config.margin}")
        return report, why
