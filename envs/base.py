"""What a single-turn task environment provides: prompts to send, and a verdict on the answer.

`reset(rng)` draws a task; `verify(task, answer)` scores the model's answer text in [0, 1].
Multi-turn and sandboxed environments build on the same two calls.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Task:
    id: str
    messages: list[dict[str, str]]
    """The conversation to send (OpenAI chat messages)."""
    answer: Any = None
    """What `verify` checks against (hidden from the model)."""
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    name: str

    def reset(self, rng: random.Random) -> Task: ...

    def verify(self, task: Task, answer: str) -> float: ...
