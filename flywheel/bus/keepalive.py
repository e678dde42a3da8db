"""Keeping held records from being redelivered, without a long ack wait.

A consumer's ack wait decides two things: how long a record may stay unacknowledged before
JetStream delivers it again, and so how soon the records of a loop that died come back to its
successor. Loops hold some records for long (an open session's turns, samples waiting for their
task group or for the next checkpoint), so the ack wait is short (`bus.ack_wait_s`) and what is
held is kept alive with progress acknowledgements (`+WPI`) every third of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

from flywheel.bus.client import Delivery


async def keep_alive(held: Callable[[], Iterable[Delivery]], ack_wait_s: float) -> None:
    """Forever: every third of the ack wait, a progress acknowledgement for each held record.
    Cancel to stop."""
    while True:
        await asyncio.sleep(ack_wait_s / 3)
        for delivery in list(held()):
            with contextlib.suppress(Exception):  # the connection is down: redelivery will cover it
                await delivery.in_progress()
