"""Environments: task sources with verifiers, sending their traffic through the serve endpoint."""

import inspect
from typing import Any

from envs.arithmetic import ArithmeticEnv
from envs.base import Env, Task
from envs.digits import DigitsEnv
from envs.humaneval import HumanEvalEnv

ENVS = {"digits": DigitsEnv, "arithmetic": ArithmeticEnv, "humaneval": HumanEvalEnv}


def make_env(name: str, args: dict[str, Any] | None = None) -> Env:
    """The environment `name` built with `args`; ValueError naming what is wrong."""
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVS))}")
    cls = ENVS[name]
    accepted = set(inspect.signature(cls).parameters)
    if unknown := sorted(set(args or {}) - accepted):
        raise ValueError(f"{name} takes no argument(s) {unknown}; it takes {sorted(accepted) or 'none'}")
    return cls(**(args or {}))


__all__ = ["ArithmeticEnv", "DigitsEnv", "ENVS", "Env", "HumanEvalEnv", "Task", "make_env"]
