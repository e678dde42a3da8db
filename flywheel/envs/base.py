"""What an environment provides, for single- and multi-turn tasks alike.

An `Env` draws tasks (`reset(rng)`, cheap: the rollout driver calls it to admit work) and opens
an `Episode` on one (`open(task, slot)`, possibly expensive: a sandbox for a SWE task). An
episode is one attempt: the conversation starts with `task.messages` (the initial
observation); each model reply goes to `step`, which acts on it and returns what the model
observes next (more messages) or that the episode is over; `finish` grades the attempt
(`Grade`: a reward and details kept on the trajectory); `close` releases what `open` took.

Episode methods may block (commands in a sandbox, test suites): callers run them off their event
loop. `slot` identifies the parallel slot an episode runs in (a sandbox's uid derives from it);
environments without per-slot resources ignore it.

Environments whose tasks are answered in a reply implement `reset` and `verify(task, answer)` and
inherit `open` from `AnswerEnv`: a reply ends the episode and `verify` scores it (with
`attempts` > 1, a wrong answer earns another try: the simplest multi-turn environment).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Task:
    id: str
    messages: list[dict[str, str]]
    """The initial observation: the conversation to send (OpenAI chat messages)."""
    answer: Any = None
    """What grading checks against (hidden from the model)."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    messages: list[dict[str, str]] = field(default_factory=list)
    """What the model observes next (appended after its reply); empty when the episode is over."""
    done: bool = False


@dataclass(frozen=True)
class Grade:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)
    """Kept on the trajectory with the reward (e.g. per-test outcomes)."""


class Episode(Protocol):
    def step(self, reply: str) -> Step: ...

    def finish(self) -> Grade: ...

    def close(self) -> None: ...


class Env(Protocol):
    name: str

    def reset(self, rng: random.Random) -> Task: ...

    def open(self, task: Task, slot: int = 0) -> Episode: ...


RETRY = "That is not right. Try again."


class AnswerEpisode:
    """Replies scored by the environment's verifier: the first right one ends the episode, and
    after `attempts` replies the last one is final."""

    def __init__(self, env: "AnswerEnv", task: Task, slot: int = 0):
        self.env, self.task, self.slot, self.answer, self.replies = env, task, slot, "", 0

    def step(self, reply: str) -> Step:
        self.answer, self.replies = reply, self.replies + 1
        if self.replies >= self.env.attempts or self.env.verify(self.task, reply, self.slot) == 1.0:
            return Step(done=True)
        return Step([{"role": "user", "content": RETRY}])

    def finish(self) -> Grade:
        return Grade(self.env.verify(self.task, self.answer, self.slot), {"attempts": self.replies})

    def close(self) -> None:
        pass


class AnswerEnv:
    """Base of environments whose tasks are answered in a reply and scored by `verify`; with
    `attempts` > 1 a wrong answer is met with a request to try again (a multi-turn episode)."""

    name: str
    attempts: int = 1

    def reset(self, rng: random.Random) -> Task:
        raise NotImplementedError

    def verify(self, task: Task, answer: str, slot: int = 0) -> float:
        """The answer's reward; `slot` is the episode's (a verifier that runs code sandboxes it there)."""
        raise NotImplementedError

    def open(self, task: Task, slot: int = 0) -> Episode:
        return AnswerEpisode(self, task, slot)
