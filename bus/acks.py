"""Pipelined JetStream publishing: send many messages, then wait for their acknowledgements.

`js.publish` in nats-py is a request per message: a reply future plus an `asyncio.wait_for`
each, and callers who publish many at once pay a task per message too. Here each message is
sent with a reply subject under one wildcard subscription, and its acknowledgement resolves a
plain future; callers wait for a whole batch at once (`Bus.publish_all`).

nats-py has the same idea as `publish_async`, but as of 2.16 it leaks its pending slot when the
send itself fails (a full reconnect buffer), and leaves the future unresolved when JetStream
answers with an error; after enough of either it blocks forever. Here a failed send removes
its future, and an error answer fails the future with the error.
"""

from __future__ import annotations

import asyncio
import json

import nats
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError

_NO_RESPONDERS = "503"


class PublishAcks:
    """Matches JetStream's acknowledgements to the messages sent through `send`."""

    def __init__(self, nc: nats.NATS):
        self._nc = nc
        self._prefix = f"{nc.new_inbox()}."
        self._pending: dict[str, asyncio.Future[PubAck]] = {}
        self._count = 0
        self._subscribed = False

    async def send(self, subject: str, payload: bytes, headers: dict[str, str]) -> asyncio.Future[PubAck]:
        """Send a message to a stream's subject; the returned future completes with its `PubAck`
        or fails with JetStream's error. Raises if the message cannot be sent at all."""
        if not self._subscribed:
            await self._nc.subscribe(f"{self._prefix}*", cb=self._on_reply)
            self._subscribed = True
        self._count += 1
        token = str(self._count)
        future: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self._pending[token] = future
        future.add_done_callback(lambda _: self._pending.pop(token, None))
        try:
            await self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
        except BaseException:
            future.cancel()
            raise
        return future

    @property
    def outstanding(self) -> int:
        """Messages sent whose acknowledgement has not arrived (nor been given up on)."""
        return len(self._pending)

    async def _on_reply(self, msg) -> None:
        future = self._pending.get(msg.subject[len(self._prefix):])
        if future is None or future.done():
            return
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            future.set_exception(NoStreamResponseError())
            return
        try:
            reply = json.loads(msg.data)
            if "error" in reply:
                future.set_exception(APIError(**reply["error"]))
            else:
                future.set_result(PubAck.from_response(reply))
        except (ValueError, TypeError, KeyError) as exc:
            future.set_exception(APIError(description=f"unreadable acknowledgement: {exc}"))
