"""Server-sent event responses that always close their generator.

Starlette's `StreamingResponse` stops iterating when the client disconnects but leaves the
async generator suspended until garbage collection. Generators here hold engine requests (to
abort) and turns (to record), so the response closes them itself, at once, however it ends.

It is also the per-token hot path of every stream, so it does less than Starlette's: the events
are iterated in the request's own task (no task group and child task per response); a watcher
task waits for the client's `http.disconnect` and cancels that task, which is what Starlette's
task group does too; and the body chunks go to the send callable stored under `BODY_SEND` in
the scope, when an outer middleware put one there (`RequestMetricsMiddleware` does), skipping
the middleware `send` wrappers that only need to see the response start. The start, and every
message of other responses, still goes through the whole middleware stack.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

BODY_SEND = "flywheel.body_send"
"""Scope key: the send callable that body messages of a started event stream may go to."""

DONE = b"data: [DONE]\n\n"
"""The event that ends a stream, in OpenAI's protocol and SGLang's."""


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = streaming = False

        async def watch_disconnect() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if streaming:  # then this task is suspended inside the try block below, where it lands
                gone = True
                task.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            streaming = True
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            body_send = scope.get(BODY_SEND) or send
            async for chunk in self._events:
                await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
            streaming = False  # the server reports the end of the response as a disconnect
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            streaming = False
            # The client went away (our watcher cancelled us): a normal end of this response.
            # Any other cancellation, or one on top of ours, goes on.
            if not gone or task.uncancel() > 0:
                raise
        finally:
            streaming = False
            watcher.cancel()
            try:
                await self._events.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
