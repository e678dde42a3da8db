"""The live progress view of a deployment in the terminal (`make run`)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def progress_table(stats: dict[str, dict[str, Any]]) -> Table:
    """One row per loop with the counters that show the flywheel turning."""
    table = Table(title="Flywheel", title_justify="left", expand=False)
    table.add_column("loop", style="bold")
    table.add_column("status")
    rows = {
        "serve": ("version", "requests", "turns", "swaps", "dropped"),
        "rollout": ("version", "running", "accepted", "failed", "reward_mean"),
        "collect": ("turns", "trajectories", "open_sessions", "duplicates"),
        "judge": ("scored", "unscored"),
        "train": ("version", "samples", "stale_dropped", "buffered"),
    }
    for kind, keys in rows.items():
        if kind not in stats:
            continue
        loop = stats[kind]
        if "error" in loop:
            table.add_row(kind, f"[red]{loop['error']}")
            continue
        cells = [f"{key}={_fmt(loop.get(key))}" for key in keys]
        if kind == "train" and loop.get("last"):
            last = loop["last"]
            cells += [f"{key}={_fmt(last.get(key))}" for key in ("reward_mean", "loss", "staleness_max")]
        table.add_row(kind, "  ".join(cells))
    return table


def progress_line(stats: dict[str, dict[str, Any]]) -> str:
    """The same, as one plain line (for logs and non-terminal output)."""
    train = stats.get("train", {})
    last = train.get("last") or {}
    rollout = stats.get("rollout", {})
    return (
        f"version={_fmt(train.get('version'))} samples={_fmt(train.get('samples'))} "
        f"batch_reward={_fmt(last.get('reward_mean'))} loss={_fmt(last.get('loss'))} "
        f"rollout_reward={_fmt(rollout.get('reward_mean'))} turns={_fmt(stats.get('serve', {}).get('turns'))}"
    )
