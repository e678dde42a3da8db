"""Offline asynchronous RL on a dataset, through the same four loops as live traffic: what
`flywheel train --config configs/NAME.yaml [--resume] [key=value ...]` runs.

The deployment is the one `flywheel up` starts (`Deployment`): serve, collect, judge, train
and the rollout driver, which sends the environment's tasks (`rollout.env`, `rollout.env_args`)
through the OpenAI endpoint and reports each verdict as feedback. `train.max_steps` bounds the
run (without it, Ctrl-C ends it); `rollout.max_head_offpolicyness` is η (0: synchronous RL).

Outputs in `run_dir`: `metrics.jsonl` (one object per trainer step), `checkpoints/`,
`weights/` (the published versions), `reward_curve.png`, `summary.json` and the resolved
`config.yaml`. `--resume` continues a stopped run from its newest checkpoint; without it, a
`run_dir` that already holds a run is refused rather than mixed into.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from statistics import fmean
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from flywheel.config import ConfigError, FlywheelConfig
from flywheel.deploy.deployment import Deployment
from flywheel.deploy.foreground import run_in_foreground
from flywheel.deploy.progress import progress_table
from flywheel.train.plot import plot_runs, read_metrics


def check_run_dir(config: FlywheelConfig) -> None:
    if not config.rollout.enabled:
        raise ConfigError("rollout.enabled: flywheel train trains on the rollout driver's traffic; it must be true")
    run_dir = Path(config.run_dir)
    used = [name for name in ("metrics.jsonl", "checkpoints", "weights", "rollout_state.json") if (run_dir / name).exists()]
    if used and not config.train.resume:
        raise ConfigError(
            f"run_dir: {run_dir} already holds a run ({', '.join(used)}); pass --resume to continue it, "
            "or choose another run_dir"
        )


def summarize(config: FlywheelConfig, started: float, stats: dict[str, Any]) -> dict[str, Any]:
    path = Path(config.run_dir) / "metrics.jsonl"
    lines = read_metrics(path) if path.exists() else []
    rewards = [m["reward_mean"] for m in lines]
    tail = max(1, min(10, len(rewards) // 4 or 1))
    train = stats.get("train", {})
    return {
        "steps": lines[-1]["step"] if lines else 0,
        "wall_s": time.monotonic() - started,
        "trainer_elapsed_s": lines[-1]["elapsed_s"] if lines else None,
        "reward_first": fmean(rewards[:tail]) if rewards else None,
        "reward_last": fmean(rewards[-tail:]) if rewards else None,
        "staleness_max": max((m["staleness_max"] for m in lines), default=0),
        "samples": train.get("samples"),
        "stale_dropped": train.get("stale_dropped"),
        "eta": config.rollout.max_head_offpolicyness,
    }


def progress_view(config: FlywheelConfig) -> Callable[[dict[str, Any]], Group]:
    """The progress table under a line saying how far the run is toward `train.max_steps`."""
    target = config.train.max_steps

    def view(stats: dict[str, Any]) -> Group:
        version = stats.get("train", {}).get("version")
        head = Text(f"step {version} / {target if target is not None else '∞'}   run dir: {config.run_dir}")
        return Group(head, progress_table(stats))

    return view


def reached_max_steps(config: FlywheelConfig) -> Callable[[dict[str, Any]], bool]:
    target = config.train.max_steps
    return lambda stats: target is not None and (stats.get("train", {}).get("version") or 0) >= target


def run_offline(config: FlywheelConfig, console: Console, refresh_s: float = 1.0) -> dict[str, Any]:
    """Run the deployment in the foreground until `train.max_steps` (or Ctrl-C); write the
    summary and the reward curve into `run_dir` and return the summary."""
    check_run_dir(config)
    started = time.monotonic()
    stats = run_in_foreground(Deployment(config), console, refresh_s, view=progress_view(config),
                              done=reached_max_steps(config))
    run_dir = Path(config.run_dir)
    summary = summarize(config, started, stats)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if (run_dir / "metrics.jsonl").exists():
        plot_runs({config.model: run_dir / "metrics.jsonl"}, run_dir / "reward_curve.png", title=f"{config.model} on {config.rollout.env}")
    return summary
