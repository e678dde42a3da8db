"""What a forget covers: a tenant with all its end users, or one end user of a tenant. The one rule
each holder of tenants' data applies when it forgets (the trainer's queued samples and its
guard's contexts, the judge's hint memory, the gateway's stored responses), and the forgets a
gateway has heard of, for the requests under way then (`Forgettings`)."""

from __future__ import annotations

import time

from flywheel.lru import LRU

BEGUN = "forget.begin"
"""The audit entry a forget puts on the log before it deletes anything (`forget`, with its report,
when it is done): whoever holds traffic stops keeping theirs at once."""
FORGETTING = frozenset({BEGUN, "forget"})


def forgets(forgotten: tuple[str, str | None], holder: tuple[str, str | None]) -> bool:
    """Whether forgetting `forgotten` (a tenant and one of its end users, or None for all of them)
    covers what `holder` (a tenant and the end user, if any, it was for) holds."""
    return holder[0] == forgotten[0] and forgotten[1] in (None, holder[1])


class Forgettings:
    """When each tenant or end user was last forgotten (as this process heard of it), so that a
    request under way then is not recorded when it ends: its turn would put their words back."""

    def __init__(self, size: int = 4096):
        self._at: LRU[tuple[str, str | None], float] = LRU(size)

    def add(self, tenant: str, user: str | None) -> None:
        self._at[(tenant, user)] = time.monotonic()

    def since(self, tenant: str, user: str | None, arrived: float) -> bool:
        """Whether a request of `tenant`'s `user` that arrived at `arrived` (monotonic) was under way
        when a forget covering them was heard of (of the whole tenant, or of that user)."""
        return any((at := self._at.peek(who)) is not None and at >= arrived
                   for who in {(tenant, None), (tenant, user)})
