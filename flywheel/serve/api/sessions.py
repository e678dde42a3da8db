"""Which session a request belongs to, and the session signals clients send.

Session id: the `X-Session-Id` header, else `metadata.session_id`, else the client's own
conversation id where its API has one (a Responses chain, Codex CLI's `session-id` header, Claude
Code's `x-claude-code-session-id`: see docs/api.md), else `user`; a request with none of
these is a one-turn session of its own (still recorded and trainable: an unpatched
client must never silently produce nothing). The session belongs to the caller's tenant: on the
bus its id is namespaced (`TenantDirectory.session`), so another tenant's same id is another
session. Consent: `X-Flywheel-Train: true|false` and the body's `store` narrow what the key's
grant allows (`consent_of`); a request not to be kept is served and never recorded.
`X-Flywheel-Memory: false` keeps a request out of the served memory (`memory.*`: none of the
person's instructions put in it, none of their corrections read from its conversation). The end
user: `X-User-Id`, else the request's `safety_identifier`, `user` or `metadata.user_id`.
`X-Turn-Type: side` marks turns that are served but not trained; `X-Session-Done: true` ends the
session with this turn; `X-Task-Id` (or `metadata.task_id`) groups sessions of one task, e.g. the
samples of one prompt, and `X-Group-Size` says how many sessions that group has in all, so the
trainer knows when it is whole.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import Field, field_validator, model_validator

from flywheel.serve.api.chat import INT64_MAX
from flywheel.serve.api.errors import APIError
from flywheel.serve.api.validation import Body
from flywheel.serve.ops.tenants import OPEN, Grant, TenantDirectory

_TRUE = {"1", "true", "yes"}
_FALSE = {"0", "false", "no", ""}


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    """The session on the bus: the client's id, namespaced by its tenant."""
    client_id: str
    """The session id as the client gave it (or the fresh one given an anonymous request)."""
    tenant: str
    user_id: str | None
    """The end user inside the tenant, when the request says."""
    train: bool
    """Consent to train on this request: its key's grant and `X-Flywheel-Train`, the stricter."""
    store: bool
    """Whether anything of the request is kept beyond it (false: served, never recorded)."""
    pii: str
    """The tenant's personal-data policy: `off`, `drop` or `redact_input` (flywheel/serve/personal_data.py)."""
    pii_entities: tuple[str, ...] | None
    turn_type: str
    task_id: str | None
    group_size: int | None
    """`X-Group-Size`: how many sessions the task group has in all (None: not said)."""
    done: bool
    anonymous: bool
    """No session id was given: a one-turn session of its own."""
    memory: bool = True
    """Whether the served memory may take this request (`X-Flywheel-Memory`, `Turn.memory`)."""
    instructions: tuple[str, ...] = ()
    """The person's instructions the served memory put in this request (`memory.*`)."""
    aspects: tuple[str, ...] = ()
    """The aspect each of `instructions` is for (`memory.best_of` checks those a rule can)."""
    opening: str = ""
    """The text the served memory opens the reply with (`memory.opening`): the end of the prompt,
    and the start of the answer the client gets."""


def consent_of(grant: Grant, headers: Mapping[str, str], store: bool | None) -> tuple[bool, bool]:
    """(train, store) for a request of `grant` with these headers and body `store`. A request
    that asks to be trained (`X-Flywheel-Train: true`) where it may not be is refused (403), and
    one that asks to be trained but not kept is a contradiction (400)."""
    asked = headers.get("x-flywheel-train", "").strip().lower()
    if asked not in _TRUE | _FALSE:
        raise APIError(400, "X-Flywheel-Train must be 'true' or 'false'", param="X-Flywheel-Train")
    kept = grant.store and store is not False
    if asked in _TRUE:
        if grant.training == "off" or not grant.store:
            raise APIError(403, f"training on tenant {grant.tenant}'s traffic is off for this key; send "
                           "X-Flywheel-Train: false or no header", param="X-Flywheel-Train", code="training_not_permitted")
        if not kept:
            raise APIError(400, "X-Flywheel-Train: true with store: false: a request that is not kept cannot be trained",
                           param="store")
        return True, True
    train = kept and grant.training == "opt_out" and asked == ""
    return train, kept


def memory_of(headers: Mapping[str, str]) -> bool:
    """Whether the served memory may take a request: `X-Flywheel-Memory`, true where not said."""
    said = headers.get("x-flywheel-memory")
    if said is not None and said.strip().lower() not in _TRUE | _FALSE - {""}:
        raise APIError(400, "X-Flywheel-Memory must be 'true' or 'false'", param="X-Flywheel-Memory")
    return said is None or said.strip().lower() in _TRUE


def header_text(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value as the text its client sent: HTTP servers read header bytes as Latin-1, and
    clients send UTF-8 (`X-User-Id: José` would otherwise be another user, `JosÃ©`, than the same
    name in the body, with an adapter of its own, and not forgotten under their name). Bytes that
    are not UTF-8 stay as Latin-1 read them."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def session_of(headers: Mapping[str, str], metadata: dict[str, str] | None, user: str | None,
               conversation: str | None = None, *, grant: Grant = OPEN, tenants: TenantDirectory | None = None,
               safety_identifier: str | None = None, store: bool | None = None) -> SessionInfo:
    """The session, end user and consent of a request of `grant` (`tenants` namespaces its
    session id; None: the open tenant's ids as sent); `store` is the body's."""
    tenant = grant.tenant
    metadata = metadata or {}
    session_id = header_text(headers, "x-session-id") or metadata.get("session_id") or conversation or user
    anonymous = not session_id
    client_id = session_id or f"anon-{uuid.uuid4().hex}"
    turn_type = headers.get("x-turn-type", "main").strip().lower()
    if turn_type not in ("main", "side"):
        raise APIError(400, "X-Turn-Type must be 'main' or 'side'", param="X-Turn-Type")
    done_header = headers.get("x-session-done", "").strip().lower()
    if done_header not in _TRUE | _FALSE:
        raise APIError(400, "X-Session-Done must be 'true' or 'false'", param="X-Session-Done")
    size_header = headers.get("x-group-size", "").strip()
    if size_header and not (size_header.isdigit() and 1 <= int(size_header) <= 1_000_000):
        raise APIError(400, "X-Group-Size must be a whole number from 1 to 1000000", param="X-Group-Size")
    train, kept = consent_of(grant, headers, store)
    return SessionInfo(
        session_id=tenants.session(tenant, client_id) if tenants else client_id,
        client_id=client_id,
        tenant=tenant,
        user_id=header_text(headers, "x-user-id") or safety_identifier or user or metadata.get("user_id"),
        train=train,
        store=kept,
        pii=grant.pii,
        pii_entities=grant.pii_entities,
        turn_type=turn_type,
        task_id=header_text(headers, "x-task-id") or metadata.get("task_id"),
        group_size=int(size_header) if size_header else None,
        done=anonymous or done_header in _TRUE,
        anonymous=anonymous,
        memory=memory_of(headers),
    )


class FeedbackRequest(Body):
    """Body of `POST /v1/sessions/{id}/feedback` (strict, and valid Unicode throughout)."""

    reward: float | None = Field(None, allow_inf_nan=False)
    interaction_id: str | None = Field(None, min_length=1, max_length=256)
    """The turn the feedback is about, by the id its answer carried in `X-Interaction-Id`."""
    turn_index: int | None = Field(None, ge=0, le=INT64_MAX)
    """The turn of the session's first conversation with this many assistant messages before it
    (a shorthand for a plain chat); without either, the feedback is about the whole session."""
    text: str | None = None
    source: str = Field("user", min_length=1, max_length=64)
    details: dict[str, Any] | None = None
    """Structured facts behind the verdict (e.g. an environment's per-test outcomes), kept on
    the trajectory for judges and analysis."""

    @field_validator("details")
    @classmethod
    def _recordable(cls, details: dict[str, Any] | None) -> dict[str, Any] | None:
        try:  # the bus carries MessagePack, whose integers are 64-bit
            msgspec.msgpack.encode(details)
        except OverflowError:
            raise ValueError("details holds an integer outside the 64-bit range; send it as a string") from None
        return details

    @model_validator(mode="after")
    def _says_something(self) -> "FeedbackRequest":
        if self.reward is None and not self.text:
            raise ValueError("feedback needs a reward or a text")
        if self.interaction_id is not None and self.turn_index is not None:
            raise ValueError("name the turn by interaction_id or by turn_index, not both")
        return self
