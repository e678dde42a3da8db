"""The OpenAI API of the gateway with the official client: streaming, n, logprobs, text
completions, client disconnects, and what each records."""

import asyncio

import httpx
import openai
import pytest

from bus_reading import recorded_turns
from waiting import until

CHAT = dict(model="tiny", messages=[{"role": "user", "content": "Write some digits."}])


async def test_streaming_chat_matches_the_recorded_turn(served, client, bus):
    stream = await client.chat.completions.create(
        **CHAT, max_tokens=16, seed=3, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Session-Id": "stream-1"},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.system_fingerprint == "flywheel-v0" for c in chunks[1:])
    [turn] = await recorded_turns(bus, 1)
    assert turn.session_id == "stream-1" and not turn.client_disconnected
    assert served.engine.tokenizer.decode(turn.output_ids, skip_special_tokens=True) == content
    assert len(turn.output_ids) == chunks[-1].usage.completion_tokens == len(turn.output_logprobs)


async def test_sync_client_streams_too(served):
    def call() -> str:
        with openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as sync:
            return "".join(c.choices[0].delta.content or "" for c in sync.chat.completions.create(**CHAT, max_tokens=5, stream=True))

    assert isinstance(await asyncio.to_thread(call), str)


async def test_n_choices_are_separate_sessions_of_one_task(served, client, bus):
    reply = await client.chat.completions.create(**CHAT, max_tokens=6, n=3, seed=1, extra_headers={"X-Session-Id": "multi"})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    recorded = await recorded_turns(bus, 3)
    assert sorted(t.session_id for t in recorded) == ["multi/0", "multi/1", "multi/2"]
    assert len({t.task_id for t in recorded}) == 1 and recorded[0].task_id
    by_session = {t.session_id: t for t in recorded}
    for choice in reply.choices:
        turn = by_session[f"multi/{choice.index}"]
        assert served.engine.tokenizer.decode(turn.output_ids, skip_special_tokens=True) == choice.message.content
    assert reply.usage.completion_tokens == sum(len(t.output_ids) for t in recorded)


async def test_streamed_n_choices_each_end_and_match_their_turns(served, client, bus):
    stream = await client.chat.completions.create(**CHAT, max_tokens=6, n=2, seed=5, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_headers={"X-Session-Id": "multi-stream"})
    chunks = [chunk async for chunk in stream]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant") == [0, 1]
    content = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            content[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(f) == 1 and f[0] in ("stop", "length") for f in finishes.values())
    assert chunks[-1].choices == []
    recorded = {t.session_id: t for t in await recorded_turns(bus, 2)}
    for i in (0, 1):
        turn = recorded[f"multi-stream/{i}"]
        assert served.engine.tokenizer.decode(turn.output_ids, skip_special_tokens=True) == content[i]
    assert chunks[-1].usage.completion_tokens == sum(len(t.output_ids) for t in recorded.values())


async def test_logprobs_are_the_recorded_behaviour_logprobs(served, client, bus):
    reply = await client.chat.completions.create(**CHAT, max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    [turn] = await recorded_turns(bus, 1)
    assert [entry.logprob for entry in content] == pytest.approx(turn.output_logprobs)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6


async def test_streamed_logprobs_cover_every_token(served, client):
    stream = await client.chat.completions.create(**CHAT, max_tokens=8, logprobs=True, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens


async def test_text_completions_from_text_and_from_token_ids(served, client, bus):
    reply = await client.completions.create(model="tiny", prompt="12 + 7 =", max_tokens=6, logprobs=2, seed=0)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == reply.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    ids = served.engine.tokenizer.encode("12 + 7 =", add_special_tokens=False)
    again = await client.completions.create(model="tiny", prompt=ids, max_tokens=6, seed=0)
    assert again.choices[0].text == choice.text  # same prompt ids, same seed
    text = ""
    async for chunk in await client.completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True):
        text += chunk.choices[0].text
    first, second, streamed = await recorded_turns(bus, 3)
    assert first.endpoint == "completions" and first.prompt == "12 + 7 =" and first.prompt_ids == ids
    assert second.prompt is None and second.prompt_ids == ids
    assert served.engine.tokenizer.decode(streamed.output_ids, skip_special_tokens=True) == text


async def test_a_client_that_disconnects_mid_stream_is_recorded_and_aborted(served, bus):
    body = {**CHAT, "max_tokens": 60, "stream": True, "temperature": 0.0}
    async with httpx.AsyncClient(base_url=served.url) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "gone"}) as response:
            assert response.status_code == 200
            lines = 0
            async for line in response.aiter_lines():
                lines += line.startswith("data:")
                if lines == 4:
                    break
    [turn] = await recorded_turns(bus, 1)
    assert turn.client_disconnected and turn.finish_reason == "abort"
    assert 0 < len(turn.output_ids) < 60 and len(turn.output_versions) == len(turn.output_ids)
    await until(lambda: served.engine.load()["num_running_reqs"] == 0)


async def test_sglang_length_extensions_ignore_eos_and_min_tokens(served, client):
    reply = await client.chat.completions.create(**CHAT, max_tokens=20, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 20 and reply.choices[0].finish_reason == "length"
    for seed in range(4):
        reply = await client.chat.completions.create(**CHAT, max_tokens=30, seed=seed, extra_body={"min_tokens": 12})
        assert reply.usage.completion_tokens >= 12
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        await client.chat.completions.create(**CHAT, max_tokens=5, extra_body={"min_tokens": -1})
