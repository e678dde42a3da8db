"""Agents that hold multi-turn sessions through the gateways, as a drill's load: the official
`openai` client (each session: `turns` chat turns that resend the growing history, then a reward
as feedback), grouped into task groups with `X-Task-Id` and `X-Group-Size`, behind a `Balancer`
in front of several gateways, until told to stop. `Load` is what they saw: the sessions every
request of which was answered 200, the ones that failed, and every 5xx (retried or not)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai


@dataclass
class Load:
    """What the agents saw."""

    answered: set[str] = field(default_factory=set)
    """Sessions whose every turn and feedback got a 200."""
    failed: dict[str, str] = field(default_factory=dict)
    server_errors: int = 0
    """5xx responses the clients received (including ones their retries hid)."""
    requests: int = 0


class Balancer(httpx.AsyncBaseTransport):
    """A load balancer in front of several gateways. Session-blind (`by_session` false): each
    request goes to the next gateway in turn. By session: a request goes to the gateway its
    session id (the `X-Session-Id` header, or the id in a `/v1/sessions/{id}/...` path) ranks
    first by rendezvous hashing, as ingress-nginx's `upstream-hash-by` does with a consistent
    hash. Either way a gateway that refuses connections is skipped for the next (what a
    balancer's health checks and retries do)."""

    def __init__(self, urls: list[str], by_session: bool = False):
        self.targets = [httpx.URL(url) for url in urls]
        self.by_session = by_session
        self.inner = httpx.AsyncHTTPTransport()
        self.turn = 0

    def _order(self, request: httpx.Request) -> list[httpx.URL]:
        session = request.headers.get("x-session-id")
        if session is None and request.url.path.startswith("/v1/sessions/"):
            session = request.url.path.split("/")[3]
        if self.by_session and session is not None:
            return sorted(self.targets, key=lambda t: hashlib.blake2b(f"{t}\0{session}".encode()).digest(), reverse=True)
        self.turn += 1
        return self.targets[self.turn % len(self.targets):] + self.targets[: self.turn % len(self.targets)]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for target in self._order(request):
            request.url = request.url.copy_with(host=target.host, port=target.port)
            try:
                return await self.inner.handle_async_request(request)
            except httpx.ConnectError:
                continue
        raise httpx.ConnectError("no gateway accepts connections", request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def agents(urls: list[str], stop: asyncio.Event, turns: int, concurrency: int, group_size: int, round_to: int,
                 tag: str = "s", by_session: bool = False, min_sessions: int = 0) -> Load:
    """Run multi-turn sessions through the gateways at `urls` (`Balancer`, by session or not),
    `concurrency` at a time, until `stop` is set and at least `min_sessions` have ended (answered
    or failed: a count of work, not of seconds, so a slower machine runs the same drill longer);
    then only until the count of sessions is a multiple of `round_to` (whole groups and training
    batches)."""
    load = Load()
    url = urls[0]

    async def count(response: httpx.Response) -> None:
        load.requests += 1
        if response.status_code >= 500:
            load.server_errors += 1

    http = httpx.AsyncClient(base_url=url, timeout=120, event_hooks={"response": [count]}, transport=Balancer(urls, by_session))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="drill", max_retries=10, http_client=http)

    async def session(i: int) -> None:
        sid, task = f"{tag}{i}", f"{tag}-task{i // group_size}"
        headers = {"X-Session-Id": sid, "X-Task-Id": task, "X-Group-Size": str(group_size)}
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Count from {i}."}]
        try:
            for turn in range(turns):
                reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                             extra_headers=headers)
                messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"and {turn}?"}]
            for attempt in range(20):
                try:
                    response = await http.post(f"/v1/sessions/{sid}/feedback", json={"reward": (i % 3) / 2, "source": "env"})
                    if response.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(min(0.25 * 2 ** attempt, 4.0))
            else:
                raise RuntimeError("feedback was never answered 200")
            load.answered.add(sid)
        except Exception as exc:
            load.failed[sid] = f"{type(exc).__name__}: {exc}"

    try:
        await sessions_until(session, stop, lambda: len(load.answered) + len(load.failed), min_sessions, round_to,
                             concurrency)
    finally:
        await client.close()
    return load


async def sessions_until(session: Callable[[int], Awaitable[None]], stop: asyncio.Event, ended: Callable[[], int],
                         min_sessions: int, round_to: int, concurrency: int) -> None:
    """Run `session(0)`, `session(1)`, ... on `concurrency` workers until `stop` is set and at
    least `min_sessions` have `ended`, then finish the round of `round_to` sessions under way (so
    that task groups and cycles of session kinds end whole)."""
    started = iter(range(10**9))
    limit: int | None = None

    async def worker() -> None:
        nonlocal limit
        for i in started:
            if stop.is_set() and (limit is not None or ended() >= min_sessions):
                limit = limit if limit is not None else -(-i // round_to) * round_to
                if i >= limit:
                    return
            await session(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
