"""Picking up where a consumer that died left off, in stream order.

A consumer holds records unacknowledged while it works on them; when it dies, JetStream delivers
them again, but only once their ack wait runs out, while records published since flow at once.
(A consumer that stops cleanly hands them back, `Consumer.hand_back`, and they come back first.)
Fed in that order, a collector would see a session's later turns (or its feedback) before its
earlier ones and close it truncated, the earlier ones forming a fragment of their own; a promoter
would count newer samples first and then pass over the older ones as applied already
(flywheel/promote/evidence.py).

So a consumer that starts with records outstanding (delivered to its predecessor, never
acknowledged) first holds everything it receives, until all of those outstanding records have
come back (or, should some never come, e.g. because a live predecessor acknowledged them, twice
the ack wait has passed), and then releases what it holds in stream order (each record once):
the sessions are rebuilt exactly as they were published, and what followed joins them in order.
Open (a predecessor left nothing outstanding, or all of it is back), it lets every fetch through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flywheel.bus import Consumer, Delivery

log = logging.getLogger(__name__)


class RestartBarrier:
    def __init__(self, outstanding: int, last_delivered: int, ack_wait_s: float, clock: Callable[[], float] = time.monotonic):
        self.outstanding = outstanding
        """Records the previous consumer held, still to come back."""
        self.last_delivered = last_delivered
        """The highest stream sequence delivered before this consumer started."""
        self._clock = clock
        self._deadline = clock() + 2 * ack_wait_s + 5.0
        self.held: list[Delivery] = []
        self.open = outstanding <= 0

    @classmethod
    async def of(cls, consumer: Consumer, ack_wait_s: float) -> RestartBarrier:
        """The barrier of a consumer starting now, from what its predecessor left outstanding."""
        return cls(*await consumer.unacknowledged(), ack_wait_s)

    def hold(self, deliveries: list[Delivery]) -> list[Delivery] | None:
        """Take `deliveries`; once the predecessor's records are all back, everything held so
        far in stream order (and None until then); open, `deliveries` themselves."""
        if self.open:
            return deliveries
        for delivery in deliveries:
            if delivery.stream_seq <= self.last_delivered:
                self.outstanding -= 1
            self.held.append(delivery)
        if self.outstanding > 0 and self._clock() < self._deadline:
            return None
        if self.outstanding > 0:
            log.warning("%d records held by the previous consumer did not come back; going on", self.outstanding)
        self.open = True
        released = {d.stream_seq: d for d in self.held}  # a record its ack wait brought back again while held: once
        self.held = []
        return [released[seq] for seq in sorted(released)]
