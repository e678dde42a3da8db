"""Waiting on a condition in tests: poll until it holds, fail the test if it never does.

One helper for every test that waits on something another task or process does (a counter the
judge loop bumps after publishing, a version the registry records), instead of sleeping.
"""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

DEFAULT_TIMEOUT_S = 120.0
"""Far beyond what any awaited condition takes on a loaded two-core machine: reaching it means
the condition will not hold."""


async def until(condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = DEFAULT_TIMEOUT_S,
                interval_s: float = 0.01) -> None:
    """Return once `condition()` (a function or a coroutine function) is true; fail the test with
    an AssertionError naming the condition after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not reached in {timeout_s:g}s: {getattr(condition, '__qualname__', condition)}")
        await asyncio.sleep(interval_s)
