"""Server-sent event responses that always close their generator.

Starlette's `StreamingResponse` stops iterating when the client disconnects but leaves the
async generator suspended until garbage collection. Generators here hold engine requests (to
abort) and turns (to record), so the response closes them itself, at once, however it ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
