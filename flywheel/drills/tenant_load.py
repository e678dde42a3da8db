"""The tenant drill's load: four tenants with different consent, storage and personal-data
policies, their agents holding multi-turn sessions through the gateway with their own keys, some
messages carrying personal data (an e-mail address, a Luhn-valid card number, a US phone number),
every session marked with strings unique to it so the audit can find any byte of it anywhere.

Tenants (`TENANTS`, the gateway's `tenants:` section):
- `open-co`: `training: opt_out`, `pii: off` (its personal data is kept and trained: the control
  that shows the audit's scans can see a value when it is there);
- `careful`: `training: opt_in` (only sessions that send `X-Flywheel-Train: true` are trained),
  `pii: drop`;
- `redacting`: `training: opt_out`, `pii: redact_input`, with a second key narrowed to
  `training: off`;
- `silent`: `store: false` (served, nothing kept).

Sessions come in task groups of `GROUP` sessions, each group of one `Kind` (`KINDS`, in turn), so a
group is trained whole or not at all; a cycle of `CYCLE` sessions holds 24 trainable ones (3 batches
of 8), and a drill runs whole cycles.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from flywheel.drills.agents import Balancer, Load, sessions_until

TENANTS: dict[str, dict[str, Any]] = {
    "open-co": {"keys": ["sk-drill-open-co"], "training": "opt_out", "pii": "off"},
    "careful": {"keys": ["sk-drill-careful"], "training": "opt_in", "pii": "drop"},
    "redacting": {"keys": ["sk-drill-redacting", {"value": "sk-drill-redacting-off", "training": "off"}],
                  "training": "opt_out", "pii": "redact_input"},
    "silent": {"keys": ["sk-drill-silent"], "training": "opt_out", "store": False, "pii": "off"},
}
"""The drill's tenants, as the configuration's `tenants:` section."""
TURNS = 3
GROUP = 4


@dataclass(frozen=True)
class Kind:
    """A kind of session: whose, how it is sent, and what the governance promises of it."""

    name: str
    tenant: str
    key: str
    train: str | None
    """The `X-Flywheel-Train` header it sends (None: none)."""
    pii: str | None
    """Where its personal data is: None, `first` (the first user message, resent every turn),
    `last` (the last turn's new user message)."""
    turns: int
    """How many of its turns may be recorded (0: none; TURNS - 1: all but the last)."""
    consent: bool
    """Whether its trajectory may be trained."""
    pii_fate: str | None = None
    """`kept` (pii off), `dropped` (never recorded), `redacted` (placeholders only), `not_kept`."""

    @property
    def trainable(self) -> bool:
        return self.turns > 0 and self.consent


KINDS: tuple[Kind, ...] = (
    Kind("open-plain", "open-co", "sk-drill-open-co", None, None, TURNS, True),
    Kind("open-pii", "open-co", "sk-drill-open-co", None, "first", TURNS, True, "kept"),
    Kind("open-untrained", "open-co", "sk-drill-open-co", "false", "first", TURNS, False, "kept"),
    Kind("careful-opted-in", "careful", "sk-drill-careful", "true", None, TURNS, True),
    Kind("careful-pii", "careful", "sk-drill-careful", "true", "first", 0, False, "dropped"),
    Kind("careful-not-opted-in", "careful", "sk-drill-careful", None, None, TURNS, False),
    Kind("careful-pii-last", "careful", "sk-drill-careful", "true", "last", TURNS - 1, True, "dropped"),
    Kind("redacting-pii", "redacting", "sk-drill-redacting", None, "first", TURNS, True, "redacted"),
    Kind("redacting-plain", "redacting", "sk-drill-redacting", None, None, TURNS, True),
    Kind("redacting-off-key", "redacting", "sk-drill-redacting-off", None, "first", TURNS, False, "redacted"),
    Kind("silent-pii", "silent", "sk-drill-silent", None, "first", 0, False, "not_kept"),
    Kind("silent-plain", "silent", "sk-drill-silent", None, None, 0, False),
)
CYCLE = GROUP * len(KINDS)
"""Sessions in one turn of every kind (48: 24 of them trainable, three batches of 8)."""
PII_TYPES = ("EMAIL_ADDRESS", "CREDIT_CARD", "PHONE_NUMBER")


def luhn_digit(body: str) -> str:
    """The check digit that makes `body` + it pass the Luhn test."""
    total = 0
    for k, char in enumerate(reversed(body)):
        d = int(char) * (2 if k % 2 == 0 else 1)
        total += d - 9 if d > 9 else d
    return str((10 - total % 10) % 10)


def pii_value(kind: str, tag: str, i: int) -> tuple[str, str]:
    """(a sentence holding it, the value) of one type, unique to session i of drill `tag`."""
    if kind == "EMAIL_ADDRESS":
        value = f"pat.{tag}x{i:05d}@example.org"
        return f"Write to me at {value} please.", value
    if kind == "CREDIT_CARD":
        body = f"4556{int(tag, 16) % 1000:03d}{i:08d}"
        digits = body + luhn_digit(body)
        value = " ".join(digits[j:j + 4] for j in range(0, 16, 4))
        return f"My card is {value}, charge it.", value
    value = f"(415) {263 + i // 10000}-{i % 10000:04d}"
    return f"Call me on {value} tomorrow.", value


@dataclass
class Session:
    """One session as its agent sent it: what the audit looks for."""

    sid: str
    kind: str
    tenant: str
    user: str
    marker: str
    """In its first user message: every recorded turn of it holds this."""
    pii_marker: str | None = None
    """In the message that holds its personal data."""
    pii_type: str | None = None
    pii: str | None = None
    """The raw value."""
    replies: list[str] = field(default_factory=list)
    feedback_status: int | None = None

    @property
    def bus_id(self) -> str:
        return f"{self.tenant}/{self.sid}"


@dataclass
class TenantLoad(Load):
    tag: str = ""
    sessions: dict[str, Session] = field(default_factory=dict)
    sent: int = 0
    """Requests sent, retries included: those above `requests` got no response (cut by a gateway's
    kill, or refused while it was down) and were sent again."""
    unexpected_feedback: int = 0
    """Feedback answered a status other than the one expected (200; 404 for a session not kept)."""

    def ended(self) -> int:
        return len(self.answered) + len(self.failed)


def kind_of(i: int) -> Kind:
    return KINDS[(i // GROUP) % len(KINDS)]


def plan(tag: str, i: int) -> Session:
    kind = kind_of(i)
    session = Session(f"{tag}s{i}", kind.name, kind.tenant, f"{kind.tenant}-user{i % 5}", f"tdm{tag}x{i:05d}s")
    if kind.pii:
        session.pii_marker = f"tdm{tag}x{i:05d}p"
        session.pii_type = PII_TYPES[i % 3]
    return session


async def tenant_agents(urls: list[str], stop: asyncio.Event, concurrency: int, min_sessions: int,
                        load: TenantLoad | None = None) -> TenantLoad:
    """Run sessions of every kind through the gateways at `urls`, `concurrency` at a time, until
    `stop` is set and `min_sessions` have ended; then up to a whole `CYCLE`. `load` (given) is
    filled as they go, so a drill can watch its progress."""
    load = load if load is not None else TenantLoad(tag=secrets.token_hex(3))
    load.tag = load.tag or secrets.token_hex(3)
    by_kind = {kind.name: kind for kind in KINDS}

    async def count(response: httpx.Response) -> None:
        load.requests += 1
        if response.status_code >= 500:
            load.server_errors += 1

    async def sending(request: httpx.Request) -> None:
        load.sent += 1

    http = httpx.AsyncClient(base_url=urls[0], timeout=120, event_hooks={"request": [sending], "response": [count]},
                             transport=Balancer(urls))
    clients = {key: openai.AsyncOpenAI(base_url=f"{urls[0]}/v1", api_key=key, max_retries=10, http_client=http)
               for key in {kind.key for kind in KINDS}}

    async def session(i: int) -> None:
        s = load.sessions[f"{load.tag}s{i}"] = plan(load.tag, i)
        kind = by_kind[s.kind]
        headers = {"X-Session-Id": s.sid, "X-Task-Id": f"{load.tag}-task{i // GROUP}", "X-Group-Size": str(GROUP),
                   "X-User-Id": s.user, **({"X-Flywheel-Train": kind.train} if kind.train else {})}
        sentence = ""
        if s.pii_type:
            sentence, s.pii = pii_value(s.pii_type, load.tag, i)
            sentence = f" {s.pii_marker} {sentence}"
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"Count from {i}. {s.marker}" + (sentence if kind.pii == "first" else "")}]
        try:
            for turn in range(TURNS):
                reply = await clients[kind.key].chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                                        extra_headers=headers)
                s.replies.append(reply.choices[0].message.content or "")
                last = kind.pii == "last" and turn == TURNS - 2
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"and {turn}?" + (sentence if last else "")}]
            await feedback(s, i, kind)
            load.answered.add(s.sid)
        except Exception as exc:  # noqa: BLE001 (whatever ended a session, it is counted as failed)
            load.failed[s.sid] = f"{type(exc).__name__}: {exc}"

    async def feedback(s: Session, i: int, kind: Kind) -> None:
        auth = {"Authorization": f"Bearer {kind.key}"}
        expected = 404 if kind.name.startswith("silent") else 200  # a session not kept does not exist
        for attempt in range(20):
            try:
                response = await http.post(f"/v1/sessions/{s.sid}/feedback", headers=auth,
                                           json={"reward": (i % 3) / 2, "source": "env"})
                s.feedback_status = response.status_code
                if response.status_code in (200, 404):
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(min(0.25 * 2 ** attempt, 4.0))
        if s.feedback_status != expected:
            load.unexpected_feedback += 1
            raise RuntimeError(f"feedback answered {s.feedback_status}, expected {expected}: {json.dumps(s.sid)}")

    try:
        await sessions_until(session, stop, load.ended, min_sessions, CYCLE, concurrency)
    finally:
        await http.aclose()
    return load
