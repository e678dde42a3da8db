"""Running a deployment in the foreground of a terminal: what `flywheel up` and `flywheel train` share.

Start the deployment (a spinner saying which loops are still starting; a line as each comes up
where the output is not a terminal), show its progress (a live table on a terminal, a plain
line per refresh elsewhere) until `done` says so or Ctrl-C / SIGTERM arrives, then stop it,
leaving no process behind, saying as each loop stops.

A signal only asks to stop (it sets an event the progress loop waits on); it does not raise into
whatever the main thread is doing. Raised as KeyboardInterrupt, a Ctrl-C that landed inside
`ray.get` (the stats call, every refresh) came back from Ray as an ordinary error of that call,
was reported as a loop's error, and the deployment went on running (seen under load, where the
stats calls take longer). Starting Ray installs a SIGTERM handler of its own, so ours is
installed again once the deployment is up.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live

from flywheel.deploy.deployment import Deployment
from flywheel.deploy.progress import progress_line, progress_table

Stats = dict[str, dict[str, Any]]


def run_in_foreground(
    deployment: Deployment,
    console: Console,
    refresh_s: float,
    view: Callable[[Stats], RenderableType] = progress_table,
    done: Callable[[Stats], bool] = lambda stats: False,
    on_started: Callable[[], None] = lambda: None,
) -> Stats:
    """Start `deployment`, show `view` of its stats until `done` (or a signal), stop it. Returns
    the last stats seen (empty if it never came up)."""
    stopping = threading.Event()

    def ask_to_stop(*_: object) -> None:
        stopping.set()

    def listen() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, ask_to_stop)

    listen()
    stats: Stats = {}
    try:
        with console.status("starting the bus, Ray and the loops...") as status:
            deployment.start(progress=status.update if console.is_terminal else console.print)
        listen()  # again: starting Ray installed its own SIGTERM handler
        if not stopping.is_set():
            on_started()
            stats = deployment.stats()
        if console.is_terminal:
            with Live(view(stats), console=console, refresh_per_second=4) as live:
                while not (stopping.is_set() or done(stats)):
                    stopping.wait(refresh_s)
                    stats = deployment.stats()
                    live.update(view(stats))
        else:
            while not (stopping.is_set() or done(stats)):
                stopping.wait(refresh_s)
                stats = deployment.stats()
                print(progress_line(stats), flush=True)
        if stopping.is_set():
            console.print("stopping...")
    finally:
        with console.status("stopping...") as status:
            deployment.stop(progress=status.update if console.is_terminal else console.print)
    return stats
