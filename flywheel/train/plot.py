"""Reward curves from `metrics.jsonl` files, as PNG (matplotlib, no display needed).

One run (`flywheel train` writes `run_dir/reward_curve.png`) or several on one figure (the
benchmarks compare runs): the batch reward per step, a moving mean over `window` steps, against
the step and against wall-clock time.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def moving_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs: dict[str, Path], out: Path, window: int = 10, title: str = "reward") -> Path:
    """One line per run (label -> metrics.jsonl): reward against step (left) and elapsed time (right)."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for label, path in runs.items():
        lines = [m for m in read_metrics(path) if m.get("reward_mean") is not None]
        if not lines:
            continue
        rewards = [m["reward_mean"] for m in lines]
        smooth = moving_mean(rewards, window)
        steps = [m["step"] for m in lines]
        minutes = [m["elapsed_s"] / 60 for m in lines]
        (line,) = by_step.plot(steps, smooth, label=label)
        by_step.plot(steps, rewards, color=line.get_color(), alpha=0.25, linewidth=0.8)
        by_time.plot(minutes, smooth, color=line.get_color(), label=label)
    by_step.set_xlabel("trainer step")
    by_time.set_xlabel("wall-clock minutes")
    by_step.set_ylabel(f"batch reward ({window}-step mean)")
    for axis in (by_step, by_time):
        axis.grid(alpha=0.3)
    by_time.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
