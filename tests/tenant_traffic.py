"""The tenants' tests' traffic: two tenants (`TENANTS_SETUP`), acme's users ada, bob and cy, each
saying a marker string (`MARKERS`) to look for wherever their records might be; a rewarded turn
of one of them (`converse`), a turn of ada's with a hint aimed at it (`hinted_session`), a judge
and a trainer behind a platform (`learning`), a user's adapter version reaching the gateway
(`published`, under `LORA`), and every file of a run directory at once (`everything_in`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai

from flywheel.judge.loop import JudgeLoop
from flywheel.models.adapter_names import user_adapter
from flywheel.train.loop import TrainLoop

from waiting import until

TENANTS_SETUP = ["serve.admin_key=root", "judge.kind=rule", "train.batch_size=1", "rollout.max_head_offpolicyness=8",
                 "tenants={acme: {training: opt_out, pii: \"off\", keys: [acme-key]}, other: {training: opt_out, keys: [other-key]}}"]
"""Two tenants: acme (users ada and bob) and other, trained unless they opt out."""
MARKERS = {"ada": "ZEBRA-7731", "bob": "OKAPI-4412", "cy": "IBIS-2093"}
"""What each of acme's users says: a string to look for wherever their records might be."""
LORA = [*TENANTS_SETUP, "adapters.kind=lora", "adapters.scope=user", "actor.optimizer.lr=0.05",
        "train.checkpoint_interval=1", "adapters.guard_drop=null"]  # the guard is test_adapter_guard.py's
"""The same with an adapter of each user's own, a trainer step and checkpoint for every turn."""
ADA, BOB = user_adapter("acme", "ada"), user_adapter("acme", "bob")


async def converse(serve, user: str, session: str, reward: float = 1.0, follow_ups: tuple[str, ...] = ()) -> None:
    """A turn of tenant acme's `user` saying their marker (and one more for each of `follow_ups`,
    said after the reply), rewarded, and the session ended."""
    client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)
    said: list[dict[str, Any]] = []
    for content in (f"My code word is {MARKERS[user]}.", *follow_ups):
        said.append({"role": "user", "content": content})
        reply = await client.chat.completions.create(
            model="tiny", messages=said, max_tokens=4, extra_headers={"X-Session-Id": session, "X-User-Id": user})
        said.append(reply.choices[0].message.model_dump(exclude_none=True))
    async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer acme-key"}) as http:
        (await http.post(f"/v1/sessions/{session}/feedback", json={"reward": reward})).raise_for_status()
        (await http.post(f"/v1/sessions/{session}/end")).raise_for_status()


async def hinted_session(serve, session: str, messages: list[dict[str, Any]], hint: str, reward: float) -> None:
    """One turn of tenant acme's user ada (temperature 1, 6 tokens), `hint` aimed at it, the
    session's `reward`, and the session ended."""
    client = openai.AsyncOpenAI(base_url=f"{serve.url}/v1", api_key="acme-key", max_retries=0)
    first = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=6, temperature=1.0,
        extra_headers={"X-Session-Id": session, "X-User-Id": "ada"})
    async with httpx.AsyncClient(base_url=serve.url, headers={"Authorization": "Bearer acme-key"}) as http:
        for body in ({"interaction_id": first.headers["x-interaction-id"], "text": hint}, {"reward": reward}):
            (await http.post(f"/v1/sessions/{session}/feedback", json=body)).raise_for_status()
        (await http.post(f"/v1/sessions/{session}/end")).raise_for_status()


@contextlib.asynccontextmanager
async def learning(serve, nats_url: str) -> AsyncIterator[TrainLoop]:
    """A judge and a trainer behind `serve`'s platform; the trainer, stopped on the way out."""
    judge, train = JudgeLoop(serve.config, nats_url), TrainLoop(serve.config, nats_url)
    await judge.start()
    await train.start()
    try:
        yield train
    finally:
        await asyncio.gather(judge.stop(), train.stop())


async def published(serve, adapter: str, version: int) -> None:
    """Until `serve`'s engines have `adapter`'s `version` (published by the trainer, loaded)."""
    await until(lambda: serve.pool.adapter_versions.get(adapter) == version)


def everything_in(run_dir) -> bytes:
    """Every file of the run directory, concatenated."""
    return b"\n".join(path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file())
