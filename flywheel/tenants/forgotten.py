"""What a forget covers: a tenant with all its end users, or one end user of a tenant. The one rule
each holder of tenants' data applies when it forgets (the trainer's queued samples and its
guard's contexts, the judge's hint memory, the gateway's stored responses), and the forgets heard
of, for what of theirs comes later (`Forgettings`)."""

from __future__ import annotations

from typing import Any

from flywheel.lru import LRU

BEGUN = "forget.begin"
"""The audit entry a forget puts on the log before it deletes anything (`forget`, with its report,
when it is done): whoever holds traffic stops keeping theirs at once."""
FORGETTING = frozenset({BEGUN, "forget"})
CLEARED = "memory.clear"
"""The audit entry that clears a person's memory (flywheel/tenants/memory_clear.py): what the
gateways serve them and the judge remembers of them until then is dropped, as a forget drops it,
and nothing else of theirs."""
MEMORY_FORGETTING = FORGETTING | {CLEARED}
"""The audit entries whose people leave the served memory."""


def forget_of(entry: Any, actions: frozenset[str] = FORGETTING) -> tuple[str, str | None, float] | None:
    """The tenant, end user (None: all of them) and Unix time of the forget an audit entry begins
    or ends (or of any of `actions`: `MEMORY_FORGETTING`, a clear too); None for any other record."""
    if getattr(entry, "action", None) not in actions:
        return None
    return entry.details["tenant"], entry.details.get("user"), entry.created_at


def target_of(tenant: str, user: str | None) -> str:
    """How the audit log names a tenant (`user` None) or one end user of it: `tenant/user`."""
    return tenant if user is None else f"{tenant}/{user}"


def forgets(forgotten: tuple[str, str | None], holder: tuple[str, str | None]) -> bool:
    """Whether forgetting `forgotten` (a tenant and one of its end users, or None for all of them)
    covers what `holder` (a tenant and the end user, if any, it was for) holds."""
    return holder[0] == forgotten[0] and forgotten[1] in (None, holder[1])


class Forgettings:
    """When each tenant or end user was last forgotten, so that what of theirs was made before then
    is not kept: a gateway's requests under way (on its monotonic clock), the records the collector
    holds or is sent late, the hints the judge would remember (on the records' and the audit
    entries' Unix times)."""

    def __init__(self, size: int = 4096):
        self._at: LRU[tuple[str, str | None], float] = LRU(size)

    def add(self, tenant: str, user: str | None, at: float) -> None:
        """`tenant`'s `user` (None: all of it) forgotten at `at`; an earlier time heard later (an
        audit log read again) does not move it back."""
        self._at[(tenant, user)] = max(at, self._at.peek((tenant, user)) or at)

    def since(self, tenant: str, user: str | None, made: float) -> bool:
        """Whether something of `tenant`'s `user` made at `made` came before a forget covering them
        (of the whole tenant, or of that user), on the clock `add` was given."""
        return any((at := self._at.peek(who)) is not None and at >= made
                   for who in {(tenant, None), (tenant, user)})
