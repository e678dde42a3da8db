"""What a forget covers: a tenant with all its end users, or one end user of a tenant. The one rule
each holder of tenants' data applies when it forgets (the trainer's queued samples and its
guard's contexts, the judge's hint memory, the gateway's stored responses)."""

from __future__ import annotations


def forgets(forgotten: tuple[str, str | None], holder: tuple[str, str | None]) -> bool:
    """Whether forgetting `forgotten` (a tenant and one of its end users, or None for all of them)
    covers what `holder` (a tenant and the end user, if any, it was for) holds."""
    return holder[0] == forgotten[0] and forgotten[1] in (None, holder[1])
