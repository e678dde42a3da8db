"""Running a deployment in the foreground of a terminal: what `deploy.up` and `train.run` share.

Start the deployment (with a spinner), show its progress (a live table on a terminal, a plain
line per refresh elsewhere) until `done` says so or Ctrl-C / SIGTERM arrives, then stop it,
leaving no process behind. SIGTERM is turned into KeyboardInterrupt so that both end the same
way: starting Ray installs a handler of its own, so ours is installed again once it is up.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live

from deploy.deployment import Deployment
from deploy.progress import progress_line, progress_table

Stats = dict[str, dict[str, Any]]


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_in_foreground(
    deployment: Deployment,
    console: Console,
    refresh_s: float,
    view: Callable[[Stats], RenderableType] = progress_table,
    done: Callable[[Stats], bool] = lambda stats: False,
    on_started: Callable[[], None] = lambda: None,
) -> Stats:
    """Start `deployment`, show `view` of its stats until `done` (or an interrupt), stop it.
    Returns the last stats seen (empty if it never came up)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    stats: Stats = {}
    try:
        with console.status("starting the bus, Ray and the loops..."):
            deployment.start()
        signal.signal(signal.SIGTERM, _raise_interrupt)  # again: starting Ray installed its own handler
        on_started()
        stats = deployment.stats()
        if console.is_terminal:
            with Live(view(stats), console=console, refresh_per_second=4) as live:
                while not done(stats):
                    time.sleep(refresh_s)
                    stats = deployment.stats()
                    live.update(view(stats))
        else:
            while not done(stats):
                time.sleep(refresh_s)
                stats = deployment.stats()
                print(progress_line(stats), flush=True)
    except KeyboardInterrupt:
        console.print("stopping...")
    finally:
        deployment.stop()
    return stats
