"""Records of any size are carried whole: a 128k-token agent turn goes from the bus through the
collector and the judge to the trainer's lookup; feedback larger than a NATS message is kept
and answered 200; a body over the gateway's limit is a 413, never a 200 that is then dropped."""

import random

import httpx
import pytest

from flywheel.bus import (
    SAMPLE_SUBJECT,
    SESSION_EVENT_SUBJECT,
    TRAJECTORY_SUBJECT,
    TURN_SUBJECT,
    SessionEvent,
    Trajectory,
)
from flywheel.collect.loop import CollectLoop
from flywheel.config import load_config
from flywheel.judge.loop import JudgeLoop
from flywheel.serve.loop import ServeLoop

from factories import make_turn

TOKENS = 128_000  # an agent context of 128k tokens (under collect.max_tokens, 128 Ki)


async def fetch(bus, subject: str, durable: str, n: int = 1) -> list:
    consumer = bus.consumer(subject, durable)
    found: list = []
    for _ in range(300):
        found += await consumer.fetch(timeout_s=0.2)
        if len(found) >= n:
            return found
    raise AssertionError(f"only {len(found)} of {n} records on {subject}")


async def test_a_128k_token_session_reaches_the_trainer_whole(bus, nats_url, tmp_path):
    rng = random.Random(0)
    prompt = [rng.randrange(2000) for _ in range(TOKENS)]
    history = [{"role": "user", "content": "word " * (TOKENS // 2)}]
    turn = make_turn(id="long", session_id="agent", messages=history, prompt_ids=prompt, output_ids=[5, 6, 7],
                     output_logprobs=[-0.5, -0.25, -0.125], output_versions=[0, 0, 0])
    config = load_config(None, [f"run_dir={tmp_path}", "collect.feedback_grace_s=0"])
    collect, judge = CollectLoop(config, nats_url), JudgeLoop(config, nats_url)
    await collect.start()
    await judge.start()
    try:
        await bus.publish(TURN_SUBJECT, turn)
        await bus.publish(SESSION_EVENT_SUBJECT, SessionEvent(id="fb", session_id="agent", kind="feedback", reward=1.0))
        [sample] = [d.record for d in await fetch(bus, SAMPLE_SUBJECT, "check-samples")]
    finally:
        await judge.stop()
        await collect.stop()
    assert await bus.resolve(sample)
    [segment] = sample.trajectory.segments
    assert len(segment.token_ids) == TOKENS + 3 and list(segment.token_ids[:TOKENS]) == prompt
    assert list(segment.logprobs[-3:]) == [-0.5, -0.25, -0.125] and sum(segment.loss_mask) == 3
    assert sample.trajectory.turns[0].messages == history and collect.stats()["malformed"] == 0


@pytest.fixture
async def served(nats_url, tmp_path):
    loop = ServeLoop(load_config(None, [f"run_dir={tmp_path}", "serve.port=0"]), nats_url)
    await loop.start()
    yield loop
    await loop.stop()


async def test_feedback_larger_than_a_nats_message_is_kept_and_a_body_over_the_limit_is_a_413(served, bus, nats_url, tmp_path):
    text = "a long critique. " * (2 * bus.nc.max_payload // 17)
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await http.post("/v1/chat/completions", json=chat, headers={"X-Session-Id": "big"})).status_code == 200
        kept = await http.post("/v1/sessions/big/feedback", json={"reward": 1.0, "text": text})
        assert kept.status_code == 200
        too_large = await http.post("/v1/sessions/big/feedback", json={"reward": 1.0, "text": "x" * (5 * 2**20)})
        assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    collect = CollectLoop(load_config(None, [f"run_dir={tmp_path}"]), nats_url)
    await collect.start()
    try:
        [trajectory] = [d.record for d in await fetch(bus, TRAJECTORY_SUBJECT, "check-trajectories")]
    finally:
        await collect.stop()
    assert isinstance(trajectory, Trajectory) and [e.text for e in trajectory.feedback] == [text]
    assert collect.stats()["trajectories"] == 1
