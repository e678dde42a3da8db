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
POLL_S = 0.02
"""Between checks: often enough not to slow a test, rarely enough that a condition asking the bus
(the registry's state of a version) adds no load worth the name."""


async def until(condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Return once `condition()` (a function or a coroutine function) is true; fail the test with
    an AssertionError saying where the condition is written after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() >= deadline:
            code = getattr(condition, "__code__", None)
            where = f"{code.co_filename}:{code.co_firstlineno}" if code else repr(condition)
            raise AssertionError(f"condition not reached in {timeout_s:g}s ({where})")
        await asyncio.sleep(POLL_S)
