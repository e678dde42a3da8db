"""A person's chat request as a gateway reads it, and the record of their instructions on MEMORY:
what the served memory's tests (`memory.*`) build."""

from __future__ import annotations

import time

from flywheel.bus.instructions import Instructions
from flywheel.serve.api.chat import ChatCompletionRequest
from flywheel.serve.api.sessions import session_of
from flywheel.serve.ops.tenants import OPEN, Grant


def chat(user: str | None, session: str | None, system: str | None = None, tenant: str = "open", role: str = "system"):
    """A chat request of `user`'s (None: names none) in `session` (None: anonymous), and its session."""
    messages = ([{"role": role, "content": system}] if system else []) + [{"role": "user", "content": "Hi"}]
    headers = {**({"x-session-id": session} if session else {}), **({"x-user-id": user} if user is not None else {})}
    return ChatCompletionRequest(model="tiny", messages=messages), session_of(headers, None, None, grant=Grant(tenant, OPEN.training, True))


def instructions(user: str | None, said: list[str], tenant: str = "open", read_from: float = 1000.0,
                 written: float | None = None) -> Instructions:
    """`user`'s record of instructions `said`, read from what was collected at `read_from`."""
    return Instructions(id=f"{tenant}-{user}-{read_from}", tenant=tenant, user_id=user, instructions=said, read=[],
                        turns=[], read_from=read_from, created_at=time.time() if written is None else written)
