"""Pipelined JetStream publishing: send many messages, then wait for their acknowledgements.

`js.publish` in nats-py is a request per message: a reply future plus an `asyncio.wait_for`
each, and callers who publish many at once pay a task per message too. Here each message is
sent with a reply subject under one wildcard subscription, and its acknowledgement resolves a
plain future; callers wait for a whole batch at once (`Bus.publish_all`).

nats-py has the same idea as `publish_async`, but as of 2.16 it leaks its pending slot when the
send itself fails (a full reconnect buffer), and leaves the future unresolved when JetStream
answers with an error; after enough of either it blocks forever. Here a failed send removes
its future, and an error answer fails the future with the error.

A message is kept until its acknowledgement comes, and `resend` sends every such one again
after a reconnect: whatever was on its way to a server that died is lost with the connection,
and otherwise its publisher would wait out the whole timeout. The copy carries the same
`Nats-Msg-Id`, so JetStream drops it if the first did arrive.
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
        self._unacked: dict[str, tuple[str, bytes, dict[str, str]]] = {}
        """What was sent under each pending token, for `resend`."""
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
        self._unacked[token] = (subject, payload, headers)
        future.add_done_callback(lambda _: self._forget(token))
        try:
            await self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
        except BaseException:
            future.cancel()
            raise
        return future

    def _forget(self, token: str) -> None:
        self._pending.pop(token, None)
        self._unacked.pop(token, None)

    async def resend(self) -> None:
        """Send every message still waiting for its acknowledgement again (after a reconnect)."""
        for token, (subject, payload, headers) in list(self._unacked.items()):
            try:
                await self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
            except Exception:  # disconnected again: the next reconnect resends it
                return

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
