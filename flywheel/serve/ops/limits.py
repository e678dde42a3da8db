"""Load limits of the gateway: request body size, concurrent generations, and a time limit.

- `install_body_limit` answers 413 to a body larger than the limit, whether its size is declared
  (`Content-Length`) or only discovered while a chunked body is read. It counts bytes as the app
  reads them and never buffers a body itself.
- `ConcurrencyLimiter` bounds the generations running at once; a bounded number of callers wait for
  a slot, and beyond that a caller gets a 429 with `Retry-After`. The line is shared fairly between
  tenants: a freed slot goes to the waiting tenant that holds the fewest (first come, first served
  within a tenant and between equals), and when the line is full, a caller whose tenant has at least
  two fewer callers in it than the longest line takes that line's newest place (the caller who had
  it gets the 429; one fewer, and taking it would only swap the two lines). One tenant's burst fills
  only its own share: it cannot keep another tenant's requests out, nor ahead of them in line beyond
  one turn.
- `request_timeout` turns a request that runs too long into a 504 (`code: timeout`): the gateway
  gave up waiting on its upstream, the engine, which is what 504 Gateway Timeout means (408 says
  the *client* was too slow to send its request). OpenAI's clients retry both.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flywheel.config.tenants import OPEN_TENANT
from flywheel.serve.api.errors import APIError, anthropic_path


def body_too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {max_body_bytes} bytes", code="request_too_large")


class BodyLimitMiddleware:
    """Pure ASGI: rejects a declared oversize body before the app runs; cuts a chunked one off
    as soon as it grows past the limit, replacing whatever the app answered with the 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit():  # the HTTP server holds a declared body to its length
            if int(declared) > self.max_body_bytes:
                await body_too_large(self.max_body_bytes).response(anthropic_path(scope["path"]))(scope, receive, send)
            else:
                await self.app(scope, receive, send)  # nothing to watch: no wrappers on the hot path
            return
        received = 0
        exceeded = False
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    exceeded = True
                    raise body_too_large(self.max_body_bytes)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if exceeded and not response_started:
                return  # the app's reaction to the cut-off body; the 413 replaces it
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not exceeded or response_started:
                raise
        if exceeded and not response_started:
            await body_too_large(self.max_body_bytes).response(anthropic_path(scope["path"]))(scope, receive, send)


def install_body_limit(app: FastAPI, max_body_bytes: int) -> None:
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)


class ConcurrencyLimiter:
    """At most `max_concurrent` holders of a slot; up to `max_queue` more wait in line, shared fairly
    between tenants (see the module)."""

    def __init__(self, max_concurrent: int, max_queue: int, retry_after_s: float):
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError("max_concurrent must be at least 1 and max_queue at least 0")
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.active = 0
        """Slots held now."""
        self.waiting = 0
        """Callers queued for a slot now."""
        self.rejected = 0
        """Callers turned away with a 429 since start."""
        self._held: collections.Counter[str] = collections.Counter()
        """Slots held by tenant."""
        self._lines: dict[str, collections.deque[tuple[int, asyncio.Future[None]]]] = {}
        """Each tenant's callers in line, in arrival order (with their place in the arrivals)."""
        self._arrivals = itertools.count()

    def _overloaded(self) -> APIError:
        self.rejected += 1
        headers = {
            "Retry-After": str(max(1, math.ceil(self.retry_after_s))),  # HTTP wants whole seconds
            "retry-after-ms": str(round(self.retry_after_s * 1000)),  # what OpenAI's clients read first
        }
        return APIError(429, "server overloaded, retry later", code="overloaded", headers=headers)

    @asynccontextmanager
    async def slot(self, tenant: str = OPEN_TENANT) -> AsyncIterator[None]:
        """Hold a slot for the body; waits in line if all are taken, or raises the 429 `APIError`
        when the line is full too (for `tenant`: see the module)."""
        await self.acquire(tenant)
        try:
            yield
        finally:
            self.release(tenant)

    async def acquire(self, tenant: str = OPEN_TENANT) -> None:
        """What `slot()` does on entry, for a slot held beyond one block (a streamed answer):
        pair it with exactly one `release()` of the same tenant."""
        if self.active < self.max_concurrent and not self.waiting:
            self._hold(tenant)
            return
        if self.waiting >= self.max_queue and not self._make_room(tenant):
            raise self._overloaded()
        turn = asyncio.get_running_loop().create_future()
        place = (next(self._arrivals), turn)
        self._lines.setdefault(tenant, collections.deque()).append(place)
        self.waiting += 1
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.release(tenant)  # the slot was handed over just as this caller gave up
            elif place in self._lines.get(tenant, ()):  # (a release may already have skipped past it)
                self._leave(tenant, place)
            raise

    def release(self, tenant: str = OPEN_TENANT) -> None:
        """Hand the slot to the first caller in line of the waiting tenant that holds the fewest
        (it stays counted in `active`), or free it."""
        self.active -= 1
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]
        while self._lines:
            fewest = min(self._lines, key=lambda t: (self._held[t], self._lines[t][0][0]))
            place = self._lines[fewest][0]
            self._leave(fewest, place)
            if not place[1].done():
                self._hold(fewest)
                place[1].set_result(None)
                return

    def _hold(self, tenant: str) -> None:
        self.active += 1
        self._held[tenant] += 1

    def _leave(self, tenant: str, place: tuple[int, asyncio.Future[None]]) -> None:
        line = self._lines[tenant]
        line.remove(place)
        self.waiting -= 1
        if not line:
            del self._lines[tenant]

    def _make_room(self, tenant: str) -> bool:
        """In a full line, the newest place of the longest tenant's line given to `tenant` (its
        caller refused with the 429), where `tenant`'s own line is at least two shorter; whether
        there is room."""
        mine = len(self._lines.get(tenant, ()))
        longest = max(self._lines, key=lambda t: len(self._lines[t]), default=None)
        if longest is None or len(self._lines[longest]) <= mine + 1:
            return False
        place = self._lines[longest][-1]
        self._leave(longest, place)
        if not place[1].done():
            place[1].set_exception(self._overloaded())
        return True


@asynccontextmanager
async def request_timeout(seconds: float) -> AsyncIterator[None]:
    """Cancel the body after `seconds` and raise a 504 `APIError` (`code: timeout`) in its place.

    Cancellation reaches whatever the body awaits (the engine call, a wait for a slot), so
    wrapping both releases the slot. A cancellation that comes from elsewhere passes through.
    """
    task = asyncio.current_task()
    assert task is not None, "request_timeout runs inside a task"
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        yield
    except asyncio.CancelledError:
        # Python 3.11+ counts cancellation requests: anything beyond ours is someone else's.
        if not expired or (sys.version_info >= (3, 11) and task.uncancel() > 0):
            raise
        raise APIError(504, f"the request did not finish within {seconds:g} s", code="timeout") from None
    finally:
        timer.cancel()
