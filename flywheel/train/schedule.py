"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay.

The factor multiplies `actor.optimizer.lr`: it rises from 1/(warmup+1) to 1 over
`warmup_steps` steps, then stays at 1 (`constant`) or falls to `min_lr_ratio` at
`schedule_steps` (default `train.max_steps`) along a line or half a cosine, and stays there.
"""

from __future__ import annotations

import math

import torch

from flywheel.config import ConfigError
from flywheel.config.actor import OptimizerConfig


def lr_factor(step: int, optimizer: OptimizerConfig, total_steps: int | None) -> float:
    """The factor for the step that follows `step` completed steps."""
    if step < optimizer.warmup_steps:
        return (step + 1) / (optimizer.warmup_steps + 1)
    if optimizer.lr_schedule == "constant":
        return 1.0
    assert total_steps is not None
    span = max(total_steps - optimizer.warmup_steps, 1)
    progress = min((step - optimizer.warmup_steps) / span, 1.0)
    shape = 1.0 - progress if optimizer.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return optimizer.min_lr_ratio + (1.0 - optimizer.min_lr_ratio) * shape


def make_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig, max_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    total = config.schedule_steps or max_steps
    if config.lr_schedule != "constant" and total is None:
        raise ConfigError(
            f"actor.optimizer.schedule_steps: a {config.lr_schedule} schedule needs it (or train.max_steps)"
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config, total))
