"""Environments: task sources with verifiers, sending their traffic through the serve endpoint."""

from envs.arithmetic import ArithmeticEnv
from envs.base import Env, Task
from envs.digits import DigitsEnv

ENVS = {"digits": DigitsEnv, "arithmetic": ArithmeticEnv}


def make_env(name: str) -> Env:
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVS))}")
    return ENVS[name]()


__all__ = ["ArithmeticEnv", "DigitsEnv", "ENVS", "Env", "Task", "make_env"]
