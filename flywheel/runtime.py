"""How a long-lived loop runs: its steps repeated through passing faults (`repeat`), its tasks
stopped for sure (`cancel_and_wait`, and `together` for tasks that stand or fall as one), and a
garbage collector tuned for many short-lived records (`tune_gc`). Every loop uses these, wherever
it is hosted (a Ray actor, a process of its own)."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


def tune_gc() -> None:
    """Collect the youngest generation every 50,000 allocations instead of 700. The loops
    allocate many short-lived objects (every decoded record) and create almost no reference
    cycles; at the default, collections cost the collect loop ~18 % of its time
    (bench/collect_judge.py) and freed nothing."""
    gc.set_threshold(50_000, 20, 100)


async def repeat(step: Callable[[], Any], name: str, backoff_s: float = 1.0) -> None:
    """Run `await step()` forever; an exception is logged and retried after a pause, so a
    passing fault (the bus restarting, a bad record) never ends a loop. Cancel to stop."""
    step_log = logging.getLogger(name)
    task = asyncio.current_task()
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            step_log.exception("%s step failed; retrying in %.1fs", name, backoff_s)
            await asyncio.sleep(backoff_s)
        if task is not None and task.cancelling():  # a library swallowed the cancellation (gh-86296)
            raise asyncio.CancelledError


async def cancel_and_wait(tasks: Iterable[asyncio.Task], patience_s: float = 2.0) -> None:
    """Cancel `tasks` and return once every one has ended. A library may swallow a cancellation
    (nats-py's publish catches CancelledError while it flushes; `wait_for` on 3.11, gh-86296), and
    a loop that misses its one cancellation runs on: a stop that cancelled once and gathered
    waited forever (the promotion test, under a loaded full suite). A task still running after
    `patience_s` is cancelled again, with its stack logged, until all have ended."""
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        done, pending = await asyncio.wait(pending, timeout=patience_s)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: an error on the way out is the loop's own to log
        for task in pending:
            stack = io.StringIO()
            task.print_stack(file=stack)
            log.warning("task %s went on after it was cancelled; cancelling it again:\n%s", task.get_name(), stack.getvalue())
            task.cancel()


async def together(*steps: Awaitable[Any]) -> None:
    """Run `steps` as tasks until one of them fails (its error raised here) or this is cancelled;
    then cancel the rest as `cancel_and_wait` does, again until they end, even if this is
    cancelled again meanwhile. Not an asyncio.TaskGroup: one that is cancelled again while it
    waits for its tasks to end does not cancel them again, so a task that swallowed its one
    cancellation kept it waiting for good (the rollout driver's stop, in a fresh clone's suite)."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        ending = asyncio.ensure_future(cancel_and_wait(tasks))
        _ending.add(ending)  # the loop keeps only weak references to tasks
        ending.add_done_callback(_ending.discard)
        await asyncio.shield(ending)


_ending: set[asyncio.Future] = set()
"""`together`'s stops under way, which go on when the caller is cancelled again."""
