"""Environments: task sources with graders, sending their traffic through the serve endpoint.

Environments are imported by name when first made, so a process loads only what it runs (the
SWE environment's task tooling stays out of a puzzle run).
"""

import inspect
from typing import Any

from flywheel.config.imports import import_object
from flywheel.envs.base import AnswerEnv, Env, Episode, Grade, Step, Task

ENVS = {
    "digits": "flywheel.envs.digits:DigitsEnv",
    "arithmetic": "flywheel.envs.arithmetic:ArithmeticEnv",
    "humaneval": "flywheel.envs.humaneval:HumanEvalEnv",
    "swe": "flywheel.envs.swe.env:SweEnv",
}


def env_class(name: str) -> type:
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVS))}")
    return import_object(ENVS[name])


def make_env(name: str, args: dict[str, Any] | None = None) -> Env:
    """The environment `name` built with `args`; ValueError naming what is wrong."""
    cls = env_class(name)
    accepted = set(inspect.signature(cls).parameters)
    if unknown := sorted(set(args or {}) - accepted):
        raise ValueError(f"{name} takes no argument(s) {unknown}; it takes {sorted(accepted) or 'none'}")
    return cls(**(args or {}))


__all__ = ["ENVS", "AnswerEnv", "Env", "Episode", "Grade", "Step", "Task", "env_class", "make_env"]
