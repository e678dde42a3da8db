"""Waiting on a condition in tests: poll until it holds, fail the test if it never does.

One helper for every test that waits on something another task or process does (a counter the
judge loop bumps after publishing, a version the registry records), instead of sleeping:
`until` in async tests, `until_sync` in synchronous ones. Both return the condition's value, so a
condition can be what the test goes on with (a fetched record, a stats snapshot).
"""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 120.0
"""Far beyond what any awaited condition takes on a loaded two-core machine: reaching it means
the condition will not hold."""
POLL_S = 0.02
"""Between checks: often enough not to slow a test, rarely enough that a condition asking the bus
(the registry's state of a version) adds no load worth the name."""


async def until(condition: Callable[[], T | Awaitable[T]], timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = POLL_S) -> T:
    """Return `condition()`'s value (a function's or a coroutine function's) once it is true; fail
    the test with an AssertionError saying where the condition is written after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return held
        if time.monotonic() >= deadline:
            raise _not_reached(condition, timeout_s)
        await asyncio.sleep(poll_s)


def until_sync(condition: Callable[[], T], timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = POLL_S) -> T:
    """`until` for synchronous tests: return `condition()`'s value once it is true, or fail the same way."""
    deadline = time.monotonic() + timeout_s
    while not (held := condition()):
        if time.monotonic() >= deadline:
            raise _not_reached(condition, timeout_s)
        time.sleep(poll_s)
    return held


def _not_reached(condition: Callable, timeout_s: float) -> AssertionError:
    code = getattr(condition, "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code else repr(condition)
    return AssertionError(f"condition not reached in {timeout_s:g}s ({where})")
